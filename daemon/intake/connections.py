"""Client connections, counted on every ROUTER the daemon binds, and refused at a daemon-wide cap.

Every connection holds a file descriptor in the daemon. When libzmq's listener
cannot accept one for lack of descriptors it aborts the whole process (ipc://,
``Too many open files (src/ipc_listener.cpp)``) or retries in a busy loop
(tcp://). So the daemon stops listening first: each ROUTER's thread reads its
socket monitor (:class:`ListenerGuard`), the counts meet in one
:class:`ConnectionBudget`, and once the daemon holds ``cap`` connections every
ROUTER stops taking new ones at its next event, without closing its listeners
(:mod:`cuctxd.daemon.intake.listeners`): connections already made stay, the
kernel turns new ones away. Once the count falls to the low-water mark, each
ROUTER takes connections again.

The cap leaves a reserve of descriptors below the open-file limit
(:func:`connection_cap`): the daemon's own files, eventfds, shares and sockets,
and the connections a listener accepts between the cap being reached and its
thread pausing it, the kernel's backlog included (a thread busy in a long driver call reacts only after it).
ZeroMQ says who connected only after the handshake, so the cap is daemon-wide,
not per peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from cuctxd.daemon.intake.listeners import IpcListener, Listener, TcpListener

log = logging.getLogger(__name__)

#: Events each ROUTER's monitor reports: a connection made or gone, a listener opened (its
#: descriptor), a listener that failed to accept.
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING | zmq.EVENT_ACCEPT_FAILED
#: Most monitor events one call handles, so that a flood of connections cannot starve requests.
EVENT_BATCH = 1024
#: Seconds between attempts to listen again after a failed attempt (a file put at the socket's path).
REBIND_RETRY_S = 1.0
#: While a ROUTER is not listening, its thread polls at least this often to notice the count fell.
PAUSED_POLL_S = 0.25


def fd_reserve(open_files: int) -> int:
    """Descriptors kept for the daemon itself at an open-file limit of ``open_files``."""
    return max(open_files // 4, min(128, open_files // 2))


def listen_backlog(open_files: int) -> int:
    """The kernel's queue of connections not accepted yet (``ZMQ_BACKLOG``, libzmq's default 100): a
    paused listener still accepts what is queued, so the queue must fit in :func:`fd_reserve`."""
    return max(8, min(100, fd_reserve(open_files) // 4))


def connection_cap(open_files: int, configured: int) -> int:
    """The cap: ``configured`` (``max_connections``; 0: none given), never above what the
    open-file limit leaves once :func:`fd_reserve` is set aside."""
    room = max(1, open_files - fd_reserve(open_files))
    if configured == 0:
        return room
    if configured > room:
        log.warning("max_connections %d is more than the open-file limit %d allows (%d are kept for the daemon's "
                    "own files): using %d", configured, open_files, fd_reserve(open_files), room)
        return room
    return configured


class ConnectionBudget:
    """The daemon-wide connection count against the cap; any thread may call (one lock).

    ``refusing`` turns on when the count reaches ``cap`` and off once it is at
    most ``low_water``: each :class:`ListenerGuard` follows it on its own thread.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.low_water = cap - max(1, cap // 10)
        self.count = 0
        self.refusing = False
        #: The most connections held at once since start (tests and the log read it).
        self.peak = 0
        self._lock = threading.Lock()

    def change(self, delta: int) -> None:
        """Add ``delta`` connections (negative: gone); logs when refusing starts and ends."""
        with self._lock:
            self.count = max(0, self.count + delta)
            self.peak = max(self.peak, self.count)
            if not self.refusing and self.count >= self.cap:
                self.refusing = True
                log.warning("max_connections reached: %d client connections open; new connections are refused "
                            "until at most %d remain", self.count, self.low_water)
            elif self.refusing and self.count <= self.low_water:
                self.refusing = False
                log.info("%d client connections open: accepting new connections again", self.count)

    def to_status(self) -> dict[str, Any]:
        return {"open": self.count, "max": self.cap, "accepting": not self.refusing}


class ListenerGuard:
    """One ROUTER's connection events and listening endpoints; owned by the thread that owns the ROUTER.

    Made before the ROUTER binds, so that no connection goes uncounted; told
    the endpoints bound by :meth:`watch`. The owner polls :attr:`monitor` next
    to the ROUTER and calls :meth:`take_events` when it is readable, and
    :meth:`check` on every wake-up (at least every :data:`PAUSED_POLL_S` while
    :attr:`paused`). The monitor's queue has no high-water mark: an event
    dropped would leave the count wrong for good.
    """

    def __init__(self, router: zmq.Socket[Any], budget: ConnectionBudget) -> None:
        self.router = router
        self.budget = budget
        address = f"inproc://cuctxd-connections-{id(self):x}"
        router.monitor(address, MONITORED)
        self.monitor: zmq.Socket[Any] = router.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)
        self._listeners: dict[str, Listener] = {}
        #: tcp:// listening descriptors, by endpoint, as the monitor reports them when bound.
        self._listening_fds: dict[str, int] = {}
        self._paused: list[Listener] = []
        self._retry_at = 0.0

    @property
    def paused(self) -> bool:
        return bool(self._paused)

    def watch(self, endpoints: Sequence[str]) -> None:
        """The endpoints bound (a tcp port resolved): those to stop and resume listening on."""
        self.take_events()
        for endpoint in endpoints:
            if endpoint.startswith("ipc://"):
                self._listeners[endpoint] = IpcListener(Path(endpoint[len("ipc://"):]))
            elif endpoint in self._listening_fds:
                self._listeners[endpoint] = TcpListener(self._listening_fds[endpoint])
            else:
                log.warning("cannot tell the listening socket of %s: max_connections cannot pause it", endpoint)

    def take_events(self) -> None:
        """Count the connections made and gone since the last call; pause the moment the cap is reached."""
        budget = self.budget
        for _ in range(EVENT_BATCH):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                budget.change(1)
                if budget.refusing and not self.paused:
                    self._pause()
            elif kind == zmq.EVENT_DISCONNECTED:
                budget.change(-1)
            elif kind == zmq.EVENT_LISTENING:
                self._listening_fds[event["endpoint"].decode()] = int(event["value"])
            elif kind == zmq.EVENT_ACCEPT_FAILED and not self.paused:
                log.warning("a listener failed to accept a connection (errno %d): refusing new connections on "
                            "%s until the count falls", event["value"], ", ".join(self._listeners))
                self._pause()
        self.check()

    def check(self) -> None:
        """Stop listening while the budget refuses; listen again once it no longer does."""
        if self.budget.refusing:
            if not self.paused:
                self._pause()
        elif self.paused and time.monotonic() >= self._retry_at:
            self._resume()

    def _pause(self) -> None:
        for endpoint, listener in self._listeners.items():
            try:
                listener.pause()
            except OSError as exc:
                log.error("cannot stop taking connections on %s: %s", endpoint, exc)
                continue
            self._paused.append(listener)

    def _resume(self) -> None:
        for listener in list(self._paused):
            try:
                listener.resume()
            except OSError as exc:
                log.warning("cannot take connections again (retrying every %g s): %s", REBIND_RETRY_S, exc)
                self._retry_at = time.monotonic() + REBIND_RETRY_S
                continue
            self._paused.remove(listener)

    def close(self) -> None:
        """Stop monitoring; before the ROUTER closes, on the owning thread."""
        for listener in self._listeners.values():
            try:
                listener.close()
            except OSError as exc:
                log.warning("cleaning up a paused listener: %s", exc)
        self.router.disable_monitor()
        self.monitor.close()
