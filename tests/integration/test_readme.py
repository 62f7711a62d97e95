"""README.md as a user meets it: every Python example and every shell block runs as written.

Each ```python block runs in its own process, in the README's order (the sharing consumer
follows its producer; the torch, transformers and Ray examples, which stand alone, beside the others),
with ``CUCTXD_ENDPOINT`` pointing at a sim daemon (the Ray example's local Ray node hands it to its
workers). Blocks that need a cluster (kubectl) are marked ```console and
do not run here.

Each ```sh block runs with bash, as a new user who followed the quick start would run it: in a fresh
directory standing for the clone (``.venv``, ``daemon/`` and ``bench/`` there are links to this checkout's),
with its own ``$HOME`` and ``$XDG_RUNTIME_DIR``, and a ``PATH`` without the virtual environment (the blocks
name ``.venv/bin/...`` themselves). Where no service manager exists, ``systemctl`` is a stand-in
(:mod:`tests.unit_file`) that starts the unit's own ``ExecStart`` as systemd would. Three choices keep CI
short, each said where it is made: a block that creates the virtual environment and installs the project
runs its commands after the install against the environment already installed (installing again is what
CI's own first line does); the test-suite block is checked to be CI's first line, not run (it would run
this suite inside itself); the CURVE block's port 5555 becomes a free port, so that runs on one machine at
once do not collide. :func:`test_every_shell_block_is_run` holds the list of blocks to the README's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cuctxd.client.cli.commands import build_parser
from tests.helpers import REPO, DaemonProcess, client_env, cuctx, cuctxd, remove_tempdir, short_tempdir, wait_until

README = (REPO / "README.md").read_text()
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())


def fenced(language: str) -> list[str]:
    """The bodies of the README's fenced blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def sh_line(needle: str) -> str:
    """The one line of the README's ```sh blocks that contains ``needle``."""
    lines = [line for block in fenced("sh") for line in block.splitlines() if needle in line]
    assert len(lines) == 1, f"expected one shell line with {needle!r}, found {lines}"
    return lines[0]


#: A block that imports one of these at its top level stands alone (no other block opens what it publishes): it starts
#: with the first block, beside the others (their imports take seconds of CPU each and Ray's start waits).
ALONE = re.compile(r"^(?:import|from) (?:torch|ray|transformers)\b", re.MULTILINE)


def test_every_python_example_runs_against_a_sim_daemon(daemon: DaemonProcess) -> None:
    blocks = fenced("python")
    assert len(blocks) >= 4, "the README's Python examples were not found"
    assert sum(bool(ALONE.search(block)) for block in blocks) >= 3, "the torch, transformers and Ray examples"
    env = dict(client_env(), CUCTXD_ENDPOINT=daemon.endpoint)

    def start(block: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", block], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=REPO)

    alone = {index: start(block) for index, block in enumerate(blocks) if ALONE.search(block)}
    outputs = {}
    try:
        for index, block in enumerate(blocks):  # the others one at a time, in order (a consumer after its producer)
            process = alone.get(index) or start(block)
            out, err = process.communicate(timeout=60 if index in alone else 30)
            assert process.returncode == 0, f"README python block {index} failed:\n{block}\n{err}"
            outputs[index] = out
    finally:
        for process in alone.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert "CUDA_ERROR_OUT_OF_MEMORY" in outputs[0], "the first example shows a CudaError's name"


def test_the_examples_import_from_the_cuctxd_namespace() -> None:
    for block in fenced("python"):
        imports = re.findall(r"^\s*(?:from|import) (\S+)", block, re.MULTILINE)
        # ray, numpy, safetensors: the Ray example's; transformers, tempfile: the N-workers example's
        allowed = {"cuctxd", "torch", "ray", "numpy", "safetensors", "transformers", "tempfile"}
        assert all(name.split(".")[0] in allowed for name in imports), imports


def test_the_daemon_command_runs_the_installed_console_script() -> None:
    line = sh_line("pip install -q -e . &&")
    assert line.startswith("python3 -m venv .venv && .venv/bin/pip install -q -e . &&")
    scripts = PYPROJECT["project"]["scripts"]
    for name in ("cuctxd", "cuctx"):
        module, function = scripts[name].split(":")
        assert callable(getattr(importlib.import_module(module), function)), scripts[name]
    assert "`python -m cuctxd.daemon` is the same program" in README
    done = cuctxd("--help")
    assert done.returncode == 0 and "--backend" in done.stdout, done.stderr


def test_the_client_calls_that_show_it_works_work(daemon: DaemonProcess) -> None:
    line = sh_line(".venv/bin/cuctx ping")
    subcommands = re.findall(r"\.venv/bin/cuctx (\w+)", line)
    assert subcommands == ["ping", "devices", "status"]
    for subcommand in subcommands:
        done = cuctx("--endpoint", daemon.endpoint, subcommand)
        assert done.returncode == 0, f"cuctx {subcommand}: {done.stderr}"
        assert done.stdout.strip(), f"cuctx {subcommand} printed nothing"


def test_the_test_command_is_the_one_ci_runs() -> None:
    line = sh_line("pytest")
    assert line == "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q"
    extras = PYPROJECT["project"]["optional-dependencies"]["test"]
    assert any(requirement.startswith(("pytest>", "pytest=")) for requirement in extras), extras
    assert line in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", re.findall(r"`((?:daemon|protos|client|tests|bench)/[\w./]+\.\w+)`", README))
def test_files_the_readme_names_exist(path: str) -> None:
    assert (REPO / path).is_file(), path


def test_the_usage_lines_name_every_cuctx_command() -> None:
    (usage,) = re.findall(r"^```\n(cuctxd \[--config FILE\].*?)^```$", README, re.MULTILINE | re.DOTALL)
    commands = [name for name in build_parser().get_default("command_parsers") if name != "help"]
    cuctx_usage = usage[usage.index("cuctx "):]
    missing = [name for name in commands if not re.search(rf"\b{name}\b", cuctx_usage)]
    assert not missing, f"the README's cuctx usage omits {missing}"


# --- the shell blocks, run as written --------------------------------------------------------------

#: What the quick start and the test command install first; the test runs what follows against the
#: environment already installed (module docstring).
INSTALL = ("python3 -m venv .venv && .venv/bin/pip install -q -e . && ",
           "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && ")


def shell_block(marker: str) -> str:
    """The one ```sh block of the README that contains ``marker``."""
    found = [block for block in fenced("sh") if marker in block]
    assert len(found) == 1, f"expected one shell block with {marker!r}, found {len(found)}"
    return found[0]


#: A marker of each shell block, and how it is proven to run (the test that runs it).
SHELL_BLOCKS = {
    ".venv/bin/cuctxd\n": "test_the_quick_start_blocks_run_as_written",
    ".venv/bin/cuctx ping && ": "test_the_quick_start_blocks_run_as_written",
    "python -m pytest -q": "test_the_test_command_is_the_one_ci_runs",
    "systemctl --user": "test_the_service_block_runs_as_written",
    "cuctxd keygen keys": "test_the_curve_block_runs_as_written",
    "python -m bench": "test_the_benchmark_block_runs_as_written",
}


def test_every_shell_block_is_run() -> None:
    blocks = fenced("sh")
    covered = [next((m for m in SHELL_BLOCKS if m in block), None) for block in blocks]
    assert None not in covered, f"a README shell block no test runs: {blocks[covered.index(None)]}"
    assert len(set(covered)) == len(blocks) == len(SHELL_BLOCKS)
    assert all(name in globals() for name in SHELL_BLOCKS.values())


@dataclass
class Newcomer:
    """A directory standing for a fresh clone after the quick start, and the environment of its user."""

    root: Path
    env: dict[str, str]

    @property
    def socket(self) -> Path:
        """Where clients look by default: ``$XDG_RUNTIME_DIR/cuctxd/cuctxd.sock``."""
        return Path(self.env["XDG_RUNTIME_DIR"]) / "cuctxd" / "cuctxd.sock"

    def run(self, script: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, env=self.env,
                              cwd=self.root, timeout=timeout, start_new_session=True)

    def start(self, script: str) -> subprocess.Popen[str]:
        """``script`` in the background, in its own process group (:func:`stop_group` ends it)."""
        return subprocess.Popen(["bash", "-e", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=self.env, cwd=self.root, start_new_session=True)


def stop_group(process: subprocess.Popen[str]) -> str:
    """SIGTERM the process group ``process`` leads (the daemon drains and exits 0); its output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return out


@pytest.fixture
def newcomer() -> Iterator[Newcomer]:
    if sys.prefix == sys.base_prefix:
        pytest.skip("the README's blocks run the virtual environment's programs: run the tests from one")
    root = short_tempdir()
    (root / ".venv").symlink_to(sys.prefix)
    for part in ("daemon", "bench"):
        (root / part).symlink_to(REPO / part)
    (root / "home").mkdir()
    (root / "run").mkdir(mode=0o700)
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != venv_bin)
    env = {key: value for key, value in client_env().items() if not key.startswith(("CUCTXD_", "NOTIFY_"))}
    env.update(HOME=str(root / "home"), XDG_RUNTIME_DIR=str(root / "run"), PATH=path)
    env.pop("PYTHONPATH", None)
    try:
        yield Newcomer(root, env)
    finally:
        remove_tempdir(root)


def test_the_quick_start_blocks_run_as_written(newcomer: Newcomer) -> None:
    daemon_block = shell_block(".venv/bin/cuctxd\n")
    assert daemon_block.startswith(INSTALL[0]), daemon_block
    daemon = newcomer.start(daemon_block[len(INSTALL[0]):])
    try:
        assert wait_until(newcomer.socket.exists, timeout=30), "the quick start's daemon did not listen"
        done = newcomer.run(shell_block(".venv/bin/cuctx ping && "))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "pong from" in done.stdout and "DEV" in done.stdout and "sessions:" in done.stdout
    finally:
        out = stop_group(daemon)
    assert daemon.returncode == 0, out


def test_the_service_block_runs_as_written(newcomer: Newcomer) -> None:
    stand_in = newcomer.root / "fake-bin" / "systemctl"
    stand_in.parent.mkdir()
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'unit_file.py'} \"$@\"\n")
    stand_in.chmod(0o755)
    (newcomer.root / "state").mkdir()
    newcomer.env.update(PATH=f"{stand_in.parent}{os.pathsep}{newcomer.env['PATH']}",
                        CUCTXD_TEST_SYSTEMCTL_STATE=str(newcomer.root / "state"))
    try:
        done = newcomer.run(shell_block("systemctl --user"))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "all checks passed" in done.stdout or "0 failed" in done.stdout, done.stdout
        unit = (newcomer.root / "home" / ".config" / "systemd" / "user" / "cuctxd.service").read_text()
        assert f"ExecStart={newcomer.root}/.venv/bin/cuctxd --config" in unit
    finally:
        pid_file = newcomer.root / "state" / "pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            assert wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=20)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_curve_block_runs_as_written(newcomer: Newcomer) -> None:
    block = shell_block("cuctxd keygen keys")
    assert block.count("5555") == 2
    ping = newcomer.start(block.replace("5555", str(_free_port())))  # the only change (module docstring)
    try:
        ping.wait(timeout=40)
    finally:
        out = stop_group(ping)
    assert ping.returncode == 0, out
    assert "pong from tcp://127.0.0.1:" in out
    assert (newcomer.root / "keys" / "clients" / "alice.key").is_file()


def test_the_benchmark_block_runs_as_written(newcomer: Newcomer) -> None:
    block = shell_block("python -m bench")
    assert block.startswith(".venv/bin/python -m bench"), "the benchmark must run with the venv's python"
    done = newcomer.run(block, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "targets met" in done.stdout
