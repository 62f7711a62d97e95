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
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuctxd.client import AsyncClient, Client
from tests.helpers import DaemonProcess, launch_daemon
from tests.service_manager import ServiceManager

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
