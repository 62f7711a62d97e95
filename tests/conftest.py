"""Fixtures shared by every test level."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cuctxd.client import Client
from tests.adversarial.attacks import FIGURES
from tests.helpers import DaemonProcess, cuda_unavailable_reason, running_daemon, start_daemon, stop_and_check
from tests.reliability.strategies import INPUTS, soak_mode


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start (daemons, CLIs, client scripts: several hundred) write and reuse compiled
    bytecode, even where this environment says not to (``PYTHONDONTWRITEBYTECODE``): compiling the daemon's
    modules afresh took about 0.1 s of each of its starts. It goes to ``__pycache__`` beside the sources, which
    git ignores (a ``PYTHONPYCACHEPREFIX`` elsewhere would also hide the installed packages' own bytecode, and
    torch's took over 20 s to compile again). This process is unchanged."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a worker process (pytest-xdist's ``-n``): hand the main process what the terminal summary prints."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["cuctxd_inputs"] = dict(INPUTS)
        output["cuctxd_figures"] = dict(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """In the main process: add up what a worker process handed over (:func:`pytest_sessionfinish`)."""
    output = getattr(node, "workeroutput", {})
    INPUTS.update(output.get("cuctxd_inputs", {}))
    FIGURES.update(output.get("cuctxd_figures", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reliability suite's count of inputs run and the adversarial suite's figures, where tests ran them."""
    mode = "soak" if soak_mode() else "ci"
    if INPUTS:
        terminalreporter.write_sep("-", f"reliability inputs run ({mode} mode)")
        for kind, count in sorted(INPUTS.items()):
            terminalreporter.write_line(f"{kind}: {count}")
        terminalreporter.write_line(f"total: {sum(INPUTS.values())}")
    if FIGURES:
        terminalreporter.write_sep("-", f"adversarial figures ({mode} mode)")
        for test, lines in FIGURES.items():
            terminalreporter.write_line(f"{test}:")
            for line in lines:
                terminalreporter.write_line(f"  {line}")


#: The folders whose modules drive a real GPU where there is one.
GPU_FOLDERS = {"gpu", "contract"}


@pytest.fixture(scope="module", autouse=True)
def one_gpu_module_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """Where a GPU runs the tests of tests/gpu and tests/contract, their modules take turns across the worker
    processes (``-n``): they read device-wide state (free memory, primary contexts) that another module's work on
    the same GPU would change. Every other module, and every module without a GPU, goes ahead at once."""
    if not GPU_FOLDERS & set(request.path.relative_to(Path(__file__).parent).parts[:1]) \
            or cuda_unavailable_reason() is not None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"cuctxd-tests-gpu-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, after the module's last test
        yield


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    """The options of a module's ``daemon``; a module that needs others overrides this fixture (module scope)."""
    return ("--sim-devices", "2", "--sim-memory", "64MiB")


@pytest.fixture(scope="module")
def daemon(daemon_args: tuple[str, ...]) -> Iterator[DaemonProcess]:
    """A real sim-backed cuctxd (by default 2 devices, 64 MiB each) shared by a test module."""
    with running_daemon(*daemon_args) as process:
        yield process


@pytest.fixture
def start_daemons() -> Iterator[Callable[..., DaemonProcess]]:
    """The daemon factory of one test: ``start_daemons(*options, **start_daemon's keywords)`` starts one; after
    the test every one is stopped, last started first, and must exit 0 (:func:`tests.helpers.stop_and_check`)."""
    started: list[DaemonProcess] = []

    def start(*extra: str, **options: object) -> DaemonProcess:
        process = start_daemon(*extra, **options)  # type: ignore[arg-type]
        started.append(process)
        return process

    yield start
    stop_and_check(*reversed(started))


@pytest.fixture
def stop_after() -> Iterator[list[DaemonProcess]]:
    """Daemons a test starts itself (with :func:`tests.helpers.start_daemon`): append each; all are stopped
    afterwards, last appended first, as :func:`start_daemons` does, and must exit 0."""
    started: list[DaemonProcess] = []
    yield started
    stop_and_check(*reversed(started))


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    """A fresh session: like a new host thread, it starts with no context."""
    with Client(daemon.endpoint, timeout=10) as session:
        yield session


#: The two ways a client can reach device ops: each device's own endpoint (the default), or the main one.
ROUTES = {"device endpoints": True, "main endpoint only": False}


@pytest.fixture(params=list(ROUTES))
def routed_client(request: pytest.FixtureRequest, daemon: DaemonProcess) -> Iterator[Client]:
    """:func:`client`, once per route: modules whose ops must behave the same both ways use it as ``client``."""
    with Client(daemon.endpoint, timeout=10, device_endpoints=ROUTES[request.param]) as session:
        yield session
