"""Helpers for tests: a real cuctxd process on a private ipc:// socket."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def short_tempdir() -> Path:
    """A private directory with a short path: ipc:// socket paths must stay under ~100 bytes."""
    return Path(tempfile.mkdtemp(prefix="cuctxd-t-", dir="/tmp"))


def start_daemon(*extra: str, backend: str = "sim", ready_timeout: float = 30.0,
                 endpoint: str | None = None) -> DaemonProcess:
    """Start ``python -m cuctxd.daemon`` and return once it prints that it is listening.

    ``endpoint``: an ipc:// endpoint to reuse (a restart on the same socket); default a new one.
    """
    if endpoint is None:
        socket_dir = short_tempdir()
        endpoint = f"ipc://{socket_dir}/d.sock"
    else:
        socket_dir = Path(endpoint[len("ipc://"):]).parent
    env = client_env()
    process = subprocess.Popen(
        [sys.executable, "-m", "cuctxd.daemon", "--endpoint", endpoint, "--backend", backend, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
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


def remove_tempdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


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


def wait_for_line(process: subprocess.Popen[str], expected: str, timeout: float = 30.0) -> str:
    """Read the process's stdout until a line contains ``expected``."""
    found = threading.Event()
    seen: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if expected in line:
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(timeout):
        process.kill()
        raise AssertionError(f"no {expected!r} from client process; it printed {''.join(seen)!r}")
    return seen[-1]


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
