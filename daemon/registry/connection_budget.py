"""The daemon-wide count of client connections against ``max_connections``, shared by every ROUTER's monitor.

Each ROUTER's :class:`~cuctxd.daemon.intake.connections.ListenerGuard` adds and takes away the connections
it sees; the :class:`~cuctxd.daemon.intake.connections.ConnectionWatch` thread pauses and resumes every
listener as :attr:`ConnectionBudget.refusing` says; ``status`` reads it on the front. Here, beside the fd
budget it is one part of, so that the daemon-wide state (:mod:`cuctxd.daemon.registry.daemon_state`) holds it
without importing the connection watch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between two warnings that the cap was reached (INFO in between).
WARN_EVERY_S = 60.0


class ConnectionBudget:
    """The daemon-wide connection count against the cap; any thread may call (one lock).

    ``refusing`` turns on when the count reaches ``cap`` and off once it is at
    most ``low_water``; the :class:`~cuctxd.daemon.intake.connections.ListenerGuard` of every ROUTER follows it.
    Each time it turns on is logged, at WARNING at most every
    :data:`WARN_EVERY_S` (a sustained flood turns it on again and again).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.low_water = cap - max(1, cap // 10)
        self.count = 0
        self.refusing = False
        self._warned_at = -WARN_EVERY_S
        self._lock = threading.Lock()

    def change(self, delta: int) -> None:
        """Add ``delta`` connections (negative: gone); logs when refusing starts and ends."""
        with self._lock:
            self.count = max(0, self.count + delta)
            if not self.refusing and self.count >= self.cap:
                self.refusing = True
                now = time.monotonic()
                quiet = now - self._warned_at < WARN_EVERY_S
                if not quiet:
                    self._warned_at = now
                log.log(logging.INFO if quiet else logging.WARNING,
                        "max_connections reached: %d client connections open; new connections are refused "
                        "until at most %d remain", self.count, self.low_water)
            elif self.refusing and self.count <= self.low_water:
                self.refusing = False
                log.info("%d client connections open: accepting new connections again", self.count)

    def to_status(self) -> dict[str, Any]:
        return {"open": self.count, "max": self.cap, "accepting": not self.refusing}
