"""systemd's notify protocol (``sd_notify``) without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

``Type=notify`` units learn that the daemon is ready (``READY=1``), what it is
doing (``STATUS=...``), that it is alive (``WATCHDOG=1``, when the unit sets
``WatchdogSec=``) and that it is shutting down (``STOPPING=1``). Without
``$NOTIFY_SOCKET`` (not started by systemd) every call is a no-op. A socket
path starting with ``@`` is in Linux's abstract namespace.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """One AF_UNIX datagram socket to systemd; :meth:`send` may be called from any thread."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        #: Seconds between the watchdog pings systemd expects (half of ``WATCHDOG_USEC``), or None.
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` as systemd sets them."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        pid = env.get("WATCHDOG_PID")
        if env.get("WATCHDOG_USEC") and (not pid or pid == str(os.getpid())):
            try:
                usec = int(env["WATCHDOG_USEC"]) or None
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", env["WATCHDOG_USEC"])
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields in one datagram; False (and a log line) if it could not go."""
        if self._socket is None or self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        data = "\n".join(fields).encode()
        with self._lock:
            try:
                self._socket.sendto(data, target)
            except OSError as exc:
                log.warning("sd_notify to %s failed: %s", self.address, exc)
                return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None
