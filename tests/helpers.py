"""Helpers for tests: a real cuctxd process on a private ipc:// socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
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

    def log(self) -> str:
        return "".join(self.stderr_lines)


def short_tempdir() -> Path:
    """A private directory with a short path: ipc:// socket paths must stay under ~100 bytes."""
    return Path(tempfile.mkdtemp(prefix="cuctxd-t-", dir="/tmp"))


def start_daemon(*extra: str, backend: str = "sim", ready_timeout: float = 30.0) -> DaemonProcess:
    """Start ``python -m daemon`` and return once it prints that it is listening."""
    socket_dir = short_tempdir()
    endpoint = f"ipc://{socket_dir}/d.sock"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "daemon", "--endpoint", endpoint, "--backend", backend, *extra],
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

    threading.Thread(target=pump_stdout, daemon=True).start()
    threading.Thread(target=pump_stderr, daemon=True).start()
    if not ready.wait(ready_timeout):
        process.kill()
        process.wait()
        raise AssertionError(f"cuctxd did not become ready in {ready_timeout} s:\n{daemon.log()}")
    return daemon


def remove_tempdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
