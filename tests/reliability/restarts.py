"""Restarting a daemon on its own endpoint as quickly as a service manager with a warm cache does, for the
tests of calls in flight across a restart (tests/reliability/test_calls_across_a_restart.py,
tests/reliability/test_load_across_a_restart.py).

A cold ``python -m cuctxd.daemon`` spends most of its start importing; a restart that quick would leave a
client's liveness probe (every second) no moment in which nothing listens. So the replacement is started
*before* the kill, held after its imports (:data:`HOLD`) until :meth:`QuickRestart.release`: the socket
file, the tcp port and the pid are then another daemon's within a fraction of a second of the kill. The
replacement is a real daemon process like any other: plainly (:func:`launch_daemon`) or under the test
service manager (:class:`~tests.service_manager.ServiceManager`, with its fd store).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuctxd.client import AsyncClient, Client
from tests.helpers import DaemonProcess, launch_daemon, remove_tempdir, start_daemon, tcp_endpoint
from tests.service_manager import ServiceManager

#: How the daemon comes back: on its endpoint at once, plainly or under the service manager, or not at all.
RESTARTS = ("plain", "service-manager", "none")
#: The client's timeout: what a call that nobody tells about the restart would wait.
TIMEOUT = 10.0
TCP = ("--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")

#: Run as ``python -c HOLD FIFO -m cuctxd.daemon ARGS``: import the daemon, wait until someone writes to
#: FIFO, then run it with ARGS (the daemon's own pid: no exec in between).
HOLD = """
import sys
from cuctxd.daemon.service.cli import main
with open(sys.argv[1], "rb") as hold:
    hold.read(1)
sys.exit(main(sys.argv[4:]))
"""


class QuickRestart:
    """A replacement daemon started now and held after its imports; :meth:`release` lets it bind and waits
    until it listens. ``how``: ``"plain"`` (:func:`launch_daemon`) or ``"service-manager"`` (``manager``'s
    :meth:`~tests.service_manager.ServiceManager.start`)."""

    def __init__(self, directory: Path, *args: str, endpoint: str, how: str = "plain",
                 manager: ServiceManager | None = None) -> None:
        self.fifo = directory / f"hold-{os.getpid()}-{id(self)}"
        os.mkfifo(self.fifo, 0o600)
        launcher = ("-c", HOLD, str(self.fifo))
        start: Callable[[], DaemonProcess]
        if how == "service-manager":
            assert manager is not None
            start = lambda: manager.start(*args, endpoint=endpoint, launcher=launcher)  # noqa: E731
        else:
            start = lambda: launch_daemon([sys.executable, *launcher], *args, endpoint=endpoint)  # noqa: E731
        self._started: list[DaemonProcess | BaseException] = []
        self._thread = threading.Thread(target=self._start, args=(start,), name="held-daemon", daemon=True)
        self._thread.start()

    def _start(self, start: Callable[[], DaemonProcess]) -> None:
        try:
            self._started.append(start())
        except BaseException as exc:  # handed to release()
            self._started.append(exc)

    def release(self, timeout: float = 30.0) -> DaemonProcess:
        """Let the replacement bind (once its imports are done) and return it once it listens."""
        with open(self.fifo, "wb") as hold:  # opens once the replacement waits on it
            hold.write(b"!")
        self._thread.join(timeout)
        self.fifo.unlink()
        assert self._started, f"the replacement daemon did not start within {timeout} s"
        started = self._started[0]
        if isinstance(started, BaseException):
            raise started
        return started


def in_flight_on(client: Client | AsyncClient) -> set[str]:
    """Where the client has calls sent and not answered: ``"main"`` (the main endpoint's socket),
    ``"device"`` (a device endpoint's) or ``"shm"`` (an shm lane). A test's signal that its request has left,
    read from the client's router: no public API says it."""
    router: Any = client._router
    where = {"main": [router.main], "device": list(router.device_sockets.values()),
             "shm": [] if getattr(router, "shm", None) is None else [lane for _, lane in router.shm.opened()]}
    return {name for name, transports in where.items() if any(t.in_flight() for t in transports)}


class Scene:
    """The daemon of one test (``args``: its options), the endpoint its client uses (``transport`` ``"tcp"``:
    a tcp:// one, else the ipc:// one), and how it dies and comes back (``restart``, one of :data:`RESTARTS`)."""

    def __init__(self, workdir: Path, transport: str, restart: str, args: tuple[str, ...]) -> None:
        self.manager = ServiceManager(workdir) if restart == "service-manager" else None
        tcp = TCP if transport == "tcp" else ()
        self.daemon = self.manager.start(*args, *tcp) if self.manager is not None else start_daemon(*args, *tcp)
        self.endpoint = tcp_endpoint(self.daemon) if tcp else self.daemon.endpoint
        again = (*args, "--endpoint", self.endpoint, "--insecure-tcp") if tcp else args
        self.held = None if restart == "none" else QuickRestart(workdir, *again, endpoint=self.daemon.endpoint,
                                                                how=restart, manager=self.manager)
        self.replacement: DaemonProcess | None = None

    def kill_and_restart(self) -> float:
        """SIGKILL the daemon and start its replacement; returns when the kill was sent (monotonic)."""
        killed = time.monotonic()
        self._kill()
        if self.held is not None:
            self.replacement = self.held.release()
        return killed

    def _kill(self) -> None:
        if self.manager is not None:
            self.manager.kill()
            return
        if self.daemon.process.poll() is None:
            os.kill(self.daemon.process.pid, signal.SIGKILL)
        self.daemon.process.wait(20)
        self.daemon.close_pipes()

    def close(self) -> int | None:
        """Stop whatever still runs; the replacement's exit status (None: there was none)."""
        if self.held is not None and self.replacement is None:  # the test failed before the kill
            self.kill_and_restart()
        try:
            if self.manager is not None:
                return self.manager.close()
            self._kill()
            return None if self.replacement is None else self.replacement.stop()
        finally:
            remove_tempdir(self.daemon.socket_dir)
