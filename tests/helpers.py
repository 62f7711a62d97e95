"""Helpers shared by the test levels: a real cuctxd process, the CLIs as subprocesses, waiting
for a condition or a log line, and what CUDA errors and the driver look like from a test.

Fixtures live in ``conftest.py``; raw wire-protocol peers in ``tests.helpers_raw``.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from cuctxd.client import Client
from cuctxd.daemon.backends.base import Ctx, Driver
from cuctxd.protos.errors import CudaError

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
READY_LINE = "listening on"


@dataclass
class DaemonProcess:
    """A running ``cuctxd``; ``endpoint`` is where clients connect."""

    process: subprocess.Popen[str]
    endpoint: str
    socket_dir: Path
    stderr_lines: list[str] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def socket_path(self) -> Path:
        return Path(self.endpoint[len("ipc://"):])

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"cuctxd did not exit within {timeout} s of SIGTERM") from None
        finally:
            self.close_pipes()

    def close_pipes(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=5)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def log(self) -> str:
        return "".join(self.stderr_lines)


def client_processes() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context of a test's client processes: each is forked from a server that imported the
    client once (``spawn`` imported it again in every child, ~0.3 s of CPU each), never from the test runner,
    whose threads (ZeroMQ's, the log pumps) a ``fork`` would copy mid-flight."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["cuctxd.client"])  # only until the server has started: the same for every test
    return context


def short_tempdir() -> Path:
    """A private directory with a short path: ipc:// socket paths must stay under ~100 bytes."""
    return Path(tempfile.mkdtemp(prefix="cuctxd-t-", dir="/tmp"))


def start_daemon(*extra: str, backend: str = "sim", ready_timeout: float = 30.0,
                 endpoint: str | None = None, open_files: int | None = None, ipc: bool = True) -> DaemonProcess:
    """Start ``python -m cuctxd.daemon`` and return once it prints that it is listening.

    ``endpoint``: an ipc:// endpoint to reuse (a restart on the same socket); default a new one.
    ``ipc=False``: no ipc:// endpoint at all (``extra`` names the tcp:// one).
    ``open_files``: the daemon's RLIMIT_NOFILE, soft and hard (set in the child before exec, which has
    no threads yet).
    """
    return launch_daemon([sys.executable], *extra, backend=backend, ready_timeout=ready_timeout, endpoint=endpoint,
                         open_files=open_files, ipc=ipc)


def launch_daemon(launcher: Sequence[str], *extra: str, backend: str = "sim", ready_timeout: float = 30.0,
                  endpoint: str | None = None, open_files: int | None = None, ipc: bool = True,
                  env: dict[str, str] | None = None, pass_fds: Sequence[int] = ()) -> DaemonProcess:
    """:func:`start_daemon` run as ``launcher + ["-m", "cuctxd.daemon", ...]`` (an exec wrapper: the daemon
    keeps its pid), in ``env`` (default :func:`client_env`), with ``pass_fds`` inherited. A primary context
    is released as soon as its last user lets go (``--primary-keep 0``, as CUDA does without a daemon)
    unless ``extra`` sets ``--primary-keep``: tests of contexts check the driver's state after a session."""
    if not any(arg.startswith("--primary-keep") for arg in extra):
        extra = ("--primary-keep", "0", *extra)
    if endpoint is None:
        socket_dir = short_tempdir()
        endpoint = f"ipc://{socket_dir}/d.sock"
    else:
        socket_dir = Path(endpoint[len("ipc://"):]).parent
    process = subprocess.Popen(
        [*launcher, "-m", "cuctxd.daemon", *(("--endpoint", endpoint) if ipc else ()), "--backend", backend,
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=client_env() if env is None else env,
        cwd=REPO, pass_fds=tuple(pass_fds),
        preexec_fn=None if open_files is None else functools.partial(_limit_open_files, open_files),
    )
    daemon = DaemonProcess(process, endpoint, socket_dir)
    ready = threading.Event()

    def pump_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if READY_LINE in line:
                ready.set()

    def pump_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            daemon.stderr_lines.append(line)

    daemon.pumps = [threading.Thread(target=pump_stdout, daemon=True),
                    threading.Thread(target=pump_stderr, daemon=True)]
    for pump in daemon.pumps:
        pump.start()
    deadline = time.monotonic() + ready_timeout
    while not ready.wait(0.05):
        if process.poll() is not None or time.monotonic() > deadline:
            break
    if not ready.is_set():
        process.kill()
        process.wait()
        daemon.close_pipes()
        raise AssertionError(f"cuctxd did not become ready in {ready_timeout} s:\n{daemon.log()}")
    return daemon


def stop_and_check(*processes: DaemonProcess, clean_log: bool = False) -> None:
    """The one teardown of a test daemon: stop each (SIGTERM, in the order given) and remove its socket
    directory whatever happens, then require that each exited 0 and, with ``clean_log``, logged no traceback."""
    codes: list[int | BaseException] = []
    for process in processes:
        try:
            codes.append(process.stop())
        except AssertionError as exc:  # it did not exit in time (it has been killed): say so below
            codes.append(exc)
        finally:
            remove_tempdir(process.socket_dir)
    for process, code in zip(processes, codes, strict=True):
        log = process.log()
        if isinstance(code, BaseException):
            raise AssertionError(f"{code}:\n{log[-5000:]}")
        assert code == 0, f"cuctxd exited with {code}:\n{log[-5000:]}"
        if clean_log:
            assert "Traceback" not in log, log[-5000:]


@contextmanager
def running_daemon(*extra: str, clean_log: bool = False, **options: object) -> Iterator[DaemonProcess]:
    """:func:`start_daemon` (``options``: its keywords) for the ``with`` block, then :func:`stop_and_check`."""
    process = start_daemon(*extra, **options)  # type: ignore[arg-type]
    try:
        yield process
    finally:
        stop_and_check(process, clean_log=clean_log)


def _limit_open_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def remove_tempdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last answer, as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (a thread busy on another CPU
    may otherwise still take a request sent right after the signal)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        return all(state in ("T", "t") for state in states)

    if not wait_until(stopped, timeout=5, interval=0.001):
        raise AssertionError(f"process {pid} did not stop within 5 s of SIGSTOP")


def session_ids(observer: Client) -> set[int]:
    """The sessions the daemon has open, as its status shows them to ``observer``."""
    return {s["session"] for s in observer.status()["sessions"]}


def wait_for_log(process: DaemonProcess, pattern: str, timeout: float = 10.0) -> re.Match[str]:
    """The first match of ``pattern`` in the daemon's stderr, waiting for it to be read."""
    deadline = time.monotonic() + timeout
    while (match := re.search(pattern, process.log())) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the daemon's log:\n{process.log()}")
        time.sleep(0.02)
    return match


def tcp_endpoint(process: DaemonProcess, timeout: float = 10.0) -> str:
    """The port a daemon started with ``--endpoint tcp://127.0.0.1:*`` was given, as its log says.

    Binding to ``*`` (the kernel picks the port) leaves no window in which another process can take
    the port, as picking a free port first and binding it afterwards would.
    """
    return wait_for_log(process, r"tcp://127\.0\.0\.1:\d+", timeout).group(0)


def cuctx(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the ``cuctx`` CLI (``python -m cuctxd.client``) to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "cuctxd.client", *args], capture_output=True, text=True,
                          env=env or client_env(), cwd=REPO, timeout=timeout)


def cuctxd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the ``cuctxd`` CLI (``python -m cuctxd.daemon``) to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "cuctxd.daemon", *args], capture_output=True, text=True,
                          env=client_env(), cwd=REPO, timeout=timeout)


def keygen(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``cuctxd keygen DIRECTORY [...]``, the real command."""
    return subprocess.run([sys.executable, "-m", "cuctxd.daemon", "keygen", str(directory), *extra],
                          capture_output=True, text=True, env=client_env(), cwd=REPO, timeout=30)


@dataclass
class KeyFiles:
    """CURVE key files made by :func:`make_key_files` under ``root``."""

    root: Path

    @property
    def server_public(self) -> Path:
        return self.root / "server" / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.root / "server" / "server.key_secret"

    @property
    def allow_dir(self) -> Path:
        return self.root / "allowed"

    def client_secret(self, name: str) -> Path:
        return self.root / "clients" / f"{name}.key_secret"

    def client(self, name: str = "alice") -> dict[str, Path]:
        """The ``server_key``/``client_key`` arguments of a client connecting as ``name``."""
        return {"server_key": self.server_public, "client_key": self.client_secret(name)}


def make_key_files(root: Path, allowed: tuple[str, ...] = ("alice",), others: tuple[str, ...] = ()) -> KeyFiles:
    """A server key pair and client pairs under ``root``; the ``allowed`` clients' public keys in ``allow_dir``."""
    made = KeyFiles(root)
    for directory, extra in [(root / "server", ()), *((root / "clients", ("--name", n)) for n in allowed + others)]:
        done = keygen(directory, *extra)
        assert done.returncode == 0, done.stderr
    made.allow_dir.mkdir()
    for name in allowed:
        (made.allow_dir / f"{name}.key").write_bytes((root / "clients" / f"{name}.key").read_bytes())
    return made


def pattern(size: int, seed: int = 0) -> bytes:
    """``size`` bytes that differ from a shifted copy of themselves (``seed`` shifts them): ``(i * 7 + seed) % 251``
    for each ``i``, made as one period of 251 repeated (a byte at a time, 20 MiB took over a second)."""
    period = bytes((i * 7 + seed) % 251 for i in range(251))
    return (period * (size // 251 + 1))[:size]


def client_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (keeping what was there)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def run_client(code: str, endpoint: str, timeout: float = 30.0) -> str:
    """Run ``code`` in a separate Python process (with ``ENDPOINT`` defined); return its stdout."""
    script = f"ENDPOINT = {endpoint!r}\n{code}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=client_env(), timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise AssertionError(f"client process failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def spawn_client(code: str, endpoint: str) -> subprocess.Popen[str]:
    """Start ``code`` in a separate Python process; use it in ``with`` so its pipes get closed."""
    script = f"ENDPOINT = {endpoint!r}\n{code}"
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=client_env(), cwd=REPO)


class _LinePump:
    """One reader of a client process's stdout, however many times a test waits on it: lines are kept in order
    and each :func:`wait_for_line` takes them from where the last one stopped (two readers of one pipe would
    each take some of the lines)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.taken = 0
        self.ended = False
        self.changed = threading.Condition()
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def take_until(self, expected: str, timeout: float) -> str | None:
        """The first line from here on that contains ``expected`` (taking it and those before it), or None."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for index in range(self.taken, len(self.lines)):
                    if expected in self.lines[index]:
                        self.taken = index + 1
                        return self.lines[index]
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    return None
                self.changed.wait(left)


_PUMPS: weakref.WeakKeyDictionary[subprocess.Popen[str], _LinePump] = weakref.WeakKeyDictionary()


def wait_for_line(process: subprocess.Popen[str], expected: str, timeout: float = 30.0) -> str:
    """Read the process's stdout until a line contains ``expected`` (after what earlier waits took)."""
    pump = _PUMPS.get(process)
    if pump is None:
        pump = _PUMPS[process] = _LinePump(process)
    line = pump.take_until(expected, timeout)
    if line is None:
        exited = process.poll()
        process.kill()
        errors = process.stderr.read()[-3000:] if process.stderr is not None and exited is not None else ""
        raise AssertionError(f"no {expected!r} from client process (exit status {exited}); it printed "
                             f"{''.join(pump.lines)!r}; stderr {errors!r}")
    return line


class HostThread:
    """A new host thread (so an empty context stack) running ``body``; ``join`` re-raises."""

    def __init__(self, body: Callable[[], T]) -> None:
        self._outcome: dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, args=(body,), name="contract-body")
        self._thread.start()

    def _run(self, body: Callable[[], object]) -> None:
        try:
            self._outcome["value"] = body()
        except BaseException as failure:
            self._outcome["error"] = failure

    def join(self, timeout: float = 30.0) -> object:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the thread body did not finish within {timeout} s"
        if "error" in self._outcome:
            raise self._outcome["error"]  # type: ignore[misc]
        return self._outcome["value"]


def in_thread(body: Callable[[], T]) -> T:
    """Run ``body`` on a new host thread and return its result or re-raise its failure."""
    return HostThread(body).join()  # type: ignore[return-value]


@contextmanager
def primary_current(driver: Driver, ordinal: int = 0) -> Iterator[Ctx]:
    """Retain the device's primary context and keep it current for the block."""
    ctx = driver.primary_ctx_retain(ordinal)
    driver.ctx_push(ctx)
    try:
        yield ctx
    finally:
        assert driver.ctx_pop() == ctx
        driver.primary_ctx_release(ordinal)


@contextmanager
def allocation(driver: Driver, size: int) -> Iterator[int]:
    """``mem_alloc`` in the current context, freed when the block ends."""
    ptr = driver.mem_alloc(size)
    try:
        yield ptr
    finally:
        driver.mem_free(ptr)


@contextmanager
def raises_cuda(name: str) -> Iterator[pytest.ExceptionInfo[CudaError]]:
    """Expect a :class:`CudaError` named ``name`` (e.g. ``CUDA_ERROR_INVALID_VALUE``)."""
    with pytest.raises(CudaError) as info:
        yield info
    assert info.value.name == name, f"expected {name}, got {info.value}"


@functools.cache
def cuda_driver_loads() -> bool:
    """Whether ``libcuda.so`` loads here (with or without a device)."""
    try:
        from cuda.bindings import driver as cu

        cu.cuDriverGetVersion()
    except (ImportError, RuntimeError):  # RuntimeError: cuda.pathfinder's DynamicLibNotFoundError
        return False
    return True


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """Why the real driver cannot run here, or None when it loads and sees a device."""
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return f"cuInit(0) failed: {err.name}"
        err, count = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS:
            return f"cuDeviceGetCount failed: {err.name}"
        if count < 1:
            return "the CUDA driver sees no device"
    except ImportError as missing:
        return f"cuda-python is not importable: {missing}"
    except RuntimeError as not_loaded:  # cuda.pathfinder's DynamicLibNotFoundError
        return f"the NVIDIA driver (libcuda.so) does not load ({type(not_loaded).__name__})"
    return None
