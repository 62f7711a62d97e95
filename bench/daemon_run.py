"""Starting and stopping the daemon under test: a real ``python -m cuctxd.daemon`` process.

It listens on a private ipc:// socket and on ``tcp://127.0.0.1:PORT`` (plaintext,
like the anchors: ``--insecure-tcp`` where the daemon has that flag). The CLI
cannot bind port 0, so a free port is found by binding a socket to port 0 and
closing it; if another process takes it in between, the daemon exits saying it
cannot listen and the start is retried on a fresh port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).absolute().parent.parent
READY_LINE = "listening on"
_PORT_ATTEMPTS = 5


class DaemonStartError(RuntimeError):
    """The daemon did not get ready; the message carries the end of its log."""


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def repo_env() -> dict[str, str]:
    """The environment for child processes: this repository first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO), PYTHONUNBUFFERED="1")


@dataclass
class DaemonRun:
    """A running daemon; ``stop`` always ends it (SIGTERM, then SIGKILL)."""

    process: subprocess.Popen[str]
    ipc: str
    tcp: str
    log_path: Path
    banner: str = ""
    pump: threading.Thread | None = None

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self.pump is not None:
            self.pump.join(timeout=5)  # it ends at EOF, now that the process is gone
        if self.process.stdout is not None:
            self.process.stdout.close()
        return code

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


def start_daemon(workdir: Path, backend: str, sim_devices: int, sim_memory: str,
                 ready_timeout: float = 120.0) -> DaemonRun:
    """Start the daemon with its ipc socket in ``workdir`` (private, short path) and wait until it listens.

    Raises :class:`DaemonStartError` if it exits or stays silent for ``ready_timeout``
    seconds (the cuda backend retains a context per device at start, which takes a while).
    """
    last_error = ""
    for attempt in range(_PORT_ATTEMPTS):
        ipc = f"ipc://{workdir}/daemon.sock"
        tcp = f"tcp://127.0.0.1:{free_tcp_port()}"
        log_path = workdir / f"daemon-{attempt}.log"
        run = _launch(ipc, tcp, log_path, backend, sim_devices, sim_memory, ready_timeout)
        if run.banner:
            return run
        run.stop()
        last_error = run.log_tail()
        if "cannot listen" not in last_error:
            break  # only a port taken in between gets better on another port
    raise DaemonStartError(f"the daemon did not start (backend {backend}):\n{last_error}")


def _tcp_flags() -> list[str]:
    """``--insecure-tcp`` where the daemon requires it for plaintext tcp:// (the anchors are plaintext too)."""
    help_text = subprocess.run([sys.executable, "-m", "cuctxd.daemon", "--help"], capture_output=True, text=True,
                               env=repo_env(), cwd=REPO, timeout=60).stdout
    return ["--insecure-tcp"] if "--insecure-tcp" in help_text else []


def _launch(ipc: str, tcp: str, log_path: Path, backend: str, sim_devices: int, sim_memory: str,
            ready_timeout: float) -> DaemonRun:
    command = [sys.executable, "-m", "cuctxd.daemon", "--endpoint", ipc, "--endpoint", tcp, *_tcp_flags(),
               "--backend", backend, "--sim-devices", str(sim_devices), "--sim-memory", sim_memory,
               "--log-level", "WARNING"]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                   text=True, env=repo_env(), cwd=REPO)
    run = DaemonRun(process, ipc, tcp, log_path)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if READY_LINE in line and not ready.is_set():
                run.banner = line.strip()
                ready.set()
        ready.set()  # the daemon exited: stop waiting

    run.pump = threading.Thread(target=pump, name="bench-daemon-stdout", daemon=True)
    run.pump.start()
    ready.wait(ready_timeout)
    return run
