"""Client connections, counted on every ROUTER the daemon binds, and refused at a daemon-wide cap.

Every connection holds a file descriptor in the daemon. When libzmq's listener
cannot accept one for lack of descriptors it aborts the whole process (ipc://,
``Too many open files (src/ipc_listener.cpp)``) or retries in a busy loop
(tcp://). So the daemon stops taking connections first: each ROUTER has a
socket monitor (:class:`ListenerGuard`), the counts meet in one
:class:`~cuctxd.daemon.registry.connection_budget.ConnectionBudget`, and once the daemon holds ``cap`` connections every
listener stops taking new ones without being closed
(:mod:`cuctxd.daemon.intake.listeners`): connections already made stay, the
kernel turns new ones away. Once the count falls to the low-water mark, the
listeners take connections again.

One thread, :class:`ConnectionWatch`, reads every monitor and pauses and
resumes every listener. It never touches a ROUTER (pausing moves a socket file
or filters a listening descriptor), so the threads that own the ROUTERs need
not poll anything more, and it reacts even while a worker is busy in a long
driver call: libzmq's I/O thread goes on accepting until the pause, so the time
it takes bounds how far the count overshoots the cap.

The cap is one part of the open-file limit (:class:`~cuctxd.daemon.registry.fd_budget.FdPlan`,
:func:`connection_cap`); beside it are the fds the daemon holds for clients and a
reserve for the daemon's own files, eventfds and sockets, and for that
overshoot: the kernel's backlog of connections not yet accepted
(:func:`listen_backlog`) and those accepted before the pause. ZeroMQ says who
connected only after the handshake, so the cap is daemon-wide, not per peer.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from cuctxd.daemon.intake.listeners import IpcListener, Listener, TcpListener
from cuctxd.daemon.registry.connection_budget import ConnectionBudget
from cuctxd.daemon.registry.fd_budget import FdLimits, FdPlan, fd_reserve

log = logging.getLogger(__name__)

#: A monitor event's first frame: the event (16 bits) and its value (32), native order, no padding
#: (zmq_socket_monitor). Read here, not with zmq.utils.monitor, which imports asyncio: 15 ms of every start.
_EVENT = struct.Struct("=hi")

#: Events each ROUTER's monitor reports: a connection made or gone, a listener opened (its
#: descriptor), a listener that failed to accept.
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING | zmq.EVENT_ACCEPT_FAILED
#: Most monitor events one call handles, so that a flood of connections cannot starve requests.
EVENT_BATCH = 1024
#: Seconds between attempts to take connections again after a failed attempt (a file put at the
#: socket's path meanwhile).
RESUME_RETRY_S = 1.0
#: While listeners are paused, the watch thread looks at least this often whether the count fell.
PAUSED_POLL_S = 0.25


def listen_backlog(open_files: int) -> int:
    """The kernel's queue of connections not accepted yet (``ZMQ_BACKLOG``, libzmq's default 100): a
    paused listener still accepts what is queued, so the queue must fit in :func:`fd_reserve`."""
    return max(8, min(100, fd_reserve(open_files) // 8))


def connection_cap(open_files: int, configured: int) -> int:
    """The cap: ``configured`` (``max_connections``; 0: none given), as :class:`FdPlan` sizes it out of the
    open-file limit beside the reserve and the fds held for clients."""
    return FdPlan.derive(open_files, FdLimits(max_connections=configured)).connections


class ListenerGuard:
    """One ROUTER's connection events and listening endpoints.

    Made on the thread that creates the ROUTER, before it binds (so that no
    connection goes uncounted), and told the endpoints bound by :meth:`watch`;
    from then on used only by the :class:`ConnectionWatch` thread, which owns
    :attr:`monitor`. The monitor's queue has no high-water mark: an event
    dropped would leave the count wrong for good.
    """

    def __init__(self, router: zmq.Socket[Any], budget: ConnectionBudget) -> None:
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
        """The endpoints bound (a tcp port resolved): those to stop and resume taking connections on."""
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
            kind, value = _EVENT.unpack(frames[0])
            if kind == zmq.EVENT_ACCEPTED:
                budget.change(1)
                if budget.refusing and not self.paused:
                    self.pause()
            elif kind == zmq.EVENT_DISCONNECTED:
                budget.change(-1)
            elif kind == zmq.EVENT_LISTENING:
                self._listening_fds[frames[1].decode()] = value
            elif kind == zmq.EVENT_ACCEPT_FAILED and not self.paused:
                log.warning("a listener failed to accept a connection (errno %d): refusing new connections on "
                            "%s until the count falls", value, ", ".join(self._listeners))
                self.pause()

    def check(self) -> None:
        """Stop taking connections while the budget refuses; take them again once it no longer does."""
        if self.budget.refusing:
            if not self.paused:
                self.pause()
        elif self.paused and time.monotonic() >= self._retry_at:
            self.resume()

    def pause(self) -> None:
        for endpoint, listener in self._listeners.items():
            if listener in self._paused:
                continue
            try:
                listener.pause()
            except OSError as exc:
                log.error("cannot stop taking connections on %s: %s", endpoint, exc)
                continue
            self._paused.append(listener)

    def resume(self) -> None:
        for listener in list(self._paused):
            try:
                listener.resume()
            except OSError as exc:
                log.warning("cannot take connections again (retrying every %g s): %s", RESUME_RETRY_S, exc)
                self._retry_at = time.monotonic() + RESUME_RETRY_S
                continue
            self._paused.remove(listener)

    def close(self) -> None:
        """Close the monitor; a socket file moved aside is removed (the daemon removes its own)."""
        for listener in self._listeners.values():
            try:
                listener.close()
            except OSError as exc:
                log.warning("cleaning up a paused listener: %s", exc)
        self.monitor.close()


class ConnectionWatch:
    """The thread that reads every :class:`ListenerGuard`'s monitor and pauses and resumes listeners.

    :meth:`add` guards, then :meth:`start`; :meth:`stop` (any thread) ends it
    and closes the guards, before the ZeroMQ context terminates. Guards never
    started are closed by :meth:`stop` on the caller's thread.
    """

    def __init__(self) -> None:
        self.guards: list[ListenerGuard] = []
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="cuctxd-connections", daemon=True)

    def add(self, guard: ListenerGuard) -> None:
        self.guards.append(guard)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.ident is None:
            self._close()
        else:
            os.eventfd_write(self._doorbell, 1)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the connection watch thread did not stop within %g s", timeout)
                return
        os.close(self._doorbell)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._doorbell, zmq.POLLIN)
        monitors: dict[zmq.Socket[Any], ListenerGuard] = {}
        for guard in self.guards:
            poller.register(guard.monitor, zmq.POLLIN)
            monitors[guard.monitor] = guard
        try:
            while True:
                paused = any(guard.paused for guard in self.guards)
                ready = poller.poll(int(PAUSED_POLL_S * 1000) if paused else None)
                for source, _ in ready:
                    if source == self._doorbell:
                        return
                    monitors[source].take_events()
                for guard in self.guards:
                    guard.check()
        except Exception:
            log.exception("the connection watch thread failed: connections are no longer counted or capped")
            for guard in self.guards:
                guard.resume()  # a listener left paused would shut every new client out for good
        finally:
            self._close()

    def _close(self) -> None:
        for guard in self.guards:
            guard.close()
