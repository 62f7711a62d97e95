"""The fd channel: one thread serving the Unix stream sockets beside the daemon's ipc:// endpoints.

ZeroMQ cannot carry file descriptors. A client that a ZeroMQ reply gave a ticket
(:mod:`cuctxd.daemon.registry.tickets`) connects here, sends the ticket
(:mod:`cuctxd.protos.fd_channel`) and gets the fds with ``SCM_RIGHTS``. This
thread owns the listening sockets and every connection; it never blocks on one:
sockets are non-blocking and served from one selector. A connection that sends
garbage, a ticket that does not redeem, nothing within ``handshake_timeout``, or
cannot take a reply at once, is answered (where it can be) and closed, with one
log line naming the peer's pid and uid (``SO_PEERCRED``); one idle for
:data:`IDLE_TIMEOUT` is closed quietly. At most ``max_connections`` are open at
once, at most ``max_connections_per_peer`` of one peer (a process, or every
process of a ``--group`` member's uid: :func:`~cuctxd.daemon.registry.fd_budget.fd_peer`),
and each counts in the daemon's fd budget: beyond, a new connection is
answered ``CUCTXD_ERROR_LIMIT_EXCEEDED`` naming the limit and closed at once,
so one client that fills its share does not keep the others' fds from them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cuctxd.daemon.registry.fd_budget import FdCharge, fd_peer
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.daemon.settings import count
from cuctxd.protos.errors import CuctxError, LimitExceeded
from cuctxd.protos.fd_channel import REQUEST_BYTES, encode_reply, parse_request, socket_address

log = logging.getLogger(__name__)

#: Seconds a connection may sit between two requests before it is closed (the client reconnects).
IDLE_TIMEOUT = 60.0
#: Defaults of ``max_fd_connections`` and ``max_fd_connections_per_peer``.
DEFAULT_MAX_FD_CONNECTIONS = 256
DEFAULT_MAX_FD_CONNECTIONS_PER_PEER = 32


@dataclass(frozen=True)
class FdChannelLimits:
    """Connections to the fd channel at once, in all and of one peer (:mod:`cuctxd.daemon.settings`)."""

    max_fd_connections: int = count(DEFAULT_MAX_FD_CONNECTIONS, "most connections to the fd channel at once",
                                    security=True, limit=True)
    max_fd_connections_per_peer: int = count(DEFAULT_MAX_FD_CONNECTIONS_PER_PEER, "most fd channel connections of "
                                             "one peer at once", zero="no limit", security=True, limit=True)

#: Connections the kernel queues for the channel's thread to accept, and how many it accepts (or refuses)
#: at most per wake-up: enough that one peer re-filling its refused connections cannot keep the queue full.
LISTEN_BACKLOG = 256
ACCEPT_BATCH = 64
#: Seconds between two warnings that connections were refused (per kind of refusal).
REFUSED_LOG_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    pid: int
    uid: int
    peer: str
    charge: FdCharge
    received: bytearray = field(default_factory=bytearray)
    #: When the connection closes unless a request completes (or, once one did, a new one starts).
    deadline: float = 0.0
    served: bool = False


class SideChannel:
    """The fd channel's listening sockets and thread; :meth:`start` binds and starts, :meth:`stop` ends both."""

    def __init__(self, paths: list[str], tickets: TicketBook, *, handshake_timeout: float,
                 limits: FdChannelLimits = FdChannelLimits()) -> None:
        """``paths``: one socket per ipc:// endpoint, in its directory; whoever assembles the daemon clears
        stale files there before :meth:`start` and sets the modes after (as for the endpoint itself).
        Connections count in ``tickets``' fd budget."""
        self.paths = paths
        self.tickets = tickets
        self.handshake_timeout = handshake_timeout
        self.limits = limits
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._connections: dict[int, _Connection] = {}
        #: Open connections by peer (only the channel's thread writes it).
        self._per_peer: dict[str, int] = {}
        self.refused = 0
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = threading.Event()
        self._refused_logged: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name="cuctxd-fd-channel", daemon=True)

    # --- any thread -------------------------------------------------------------------

    def start(self) -> None:
        for path in self.paths:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(socket_address(path))
                listener.listen(LISTEN_BACKLOG)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
            self._listeners.append(listener)
            self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self.thread.start()

    def stop(self) -> None:
        """End the thread, close every socket, remove the socket files and drop undelivered fds."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        if self.thread.ident is not None:
            self.thread.join(5.0)
        for listener in self._listeners:
            listener.close()
        for path in self.paths:
            if not path.startswith("@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.tickets.close()

    def stats(self) -> dict[str, Any]:
        """For ``status``: open connections, their caps, those refused, and the tickets waiting (any thread)."""
        return {"connections": len(self._connections), "max_connections": self.limits.max_fd_connections,
                "max_connections_per_peer": self.limits.max_fd_connections_per_peer, "refused": self.refused,
                **self.tickets.stats()}

    # --- the channel's thread -------------------------------------------------------------

    def _run(self) -> None:
        next_sweep = time.monotonic() + 1.0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                deadline = min([next_sweep, *(c.deadline for c in self._connections.values())])
                for key, _ in self._selector.select(max(0.0, deadline - now)):
                    if key.fileobj in self._listeners:
                        for _ in range(ACCEPT_BATCH):
                            if not self._accept(key.fileobj):  # type: ignore[arg-type]
                                break
                    elif key.data is not None:
                        self._serve(key.data)
                now = time.monotonic()
                for connection in [c for c in self._connections.values() if c.deadline <= now]:
                    if connection.received:
                        self._drop(connection, "did not complete its request within handshake_timeout")
                    elif not connection.served:
                        self._drop(connection, "sent nothing within handshake_timeout")
                    else:
                        self._drop(connection, None)  # idle: the client reconnects when it needs to
                if now >= next_sweep:
                    self.tickets.expire(now)
                    next_sweep = now + 1.0
        except Exception:
            log.exception("the fd channel failed; clients cannot receive fds until the daemon restarts")
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection, None)
            self._selector.close()

    def _accept(self, listener: socket.socket) -> bool:
        """Take (or refuse) one connection; False when none was waiting."""
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as error:  # EMFILE, ENFILE, ENOBUFS: the connection waits in the queue
            self._log_refusal("accept", f"cannot accept a connection: {error}")
            return False
        sock.setblocking(False)
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            peer = fd_peer(uid, pid)
            mine = self._per_peer.get(peer, 0)
            if self.limits.max_fd_connections and len(self._connections) >= self.limits.max_fd_connections:
                raise LimitExceeded(f"max_fd_connections: {len(self._connections)} fd channel connections are "
                                    "open; try again later")
            if self.limits.max_fd_connections_per_peer and mine >= self.limits.max_fd_connections_per_peer:
                raise LimitExceeded(f"max_fd_connections_per_peer: this client ({peer}) has {mine} fd channel "
                                    "connections open; use (or close) those")
            charge = self.tickets.budget.charge(1, "an fd channel connection", peer)
        except LimitExceeded as refused:
            self._refuse(sock, refused)
            return True
        except OSError as error:
            log.warning("fd channel: cannot take a connection: %s", error)
            sock.close()
            return True
        connection = _Connection(sock, pid, uid, peer, charge, deadline=time.monotonic() + self.handshake_timeout)
        self._connections[sock.fileno()] = connection
        self._per_peer[peer] = mine + 1
        self._selector.register(sock, selectors.EVENT_READ, connection)
        return True

    def _refuse(self, sock: socket.socket, refused: LimitExceeded) -> None:
        """Answer a connection over a limit with the error (the reply a request would get) and close it."""
        self.refused += 1
        self._reply_to(sock, {"error": {"code": refused.code, "name": refused.name, "message": refused.message}}, [])
        sock.close()
        self._log_refusal(refused.message.split(":", 1)[0],
                          f"refusing new connections: {refused.message} ({len(self._connections)} open)")

    def _log_refusal(self, key: str, text: str) -> None:
        """A warning, at most every :data:`REFUSED_LOG_EVERY_S` per kind ``key``."""
        now = time.monotonic()
        if now - self._refused_logged.get(key, -REFUSED_LOG_EVERY_S) >= REFUSED_LOG_EVERY_S:
            self._refused_logged[key] = now
            log.warning("fd channel: %s", text)

    def _serve(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(REQUEST_BYTES - len(connection.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._drop(connection, f"failed: {error}")
            return
        if not data:
            self._drop(connection, None if not connection.received else "closed in the middle of a request")
            return
        if not connection.received:
            connection.deadline = time.monotonic() + self.handshake_timeout
        connection.received += data
        if len(connection.received) < REQUEST_BYTES:
            return
        request, connection.received = bytes(connection.received), bytearray()
        try:
            ticket = parse_request(request)
        except ValueError:
            self._drop(connection, "sent something that is not an fd channel request")
            return
        try:
            fds, info = self.tickets.redeem(ticket, connection.uid)
        except CuctxError as error:
            self._reply(connection, {"error": {"code": error.code, "name": error.name, "message": error.message}},
                        [])
            self._drop(connection, "presented a ticket that does not redeem (wrong, used or expired)")
            return
        try:
            if not self._reply(connection, {"fds": len(fds), "info": info}, fds):
                self._drop(connection, "did not take its reply")
                return
        finally:
            for fd in fds:
                os.close(fd)
        connection.served = True
        connection.deadline = time.monotonic() + IDLE_TIMEOUT

    @staticmethod
    def _reply(connection: _Connection, body: dict[str, Any], fds: list[int]) -> bool:
        """Send the whole reply now (fds with its first bytes); False if the peer cannot take it."""
        return SideChannel._reply_to(connection.sock, body, fds)

    @staticmethod
    def _reply_to(sock: socket.socket, body: dict[str, Any], fds: list[int]) -> bool:
        data = encode_reply(body)
        try:
            sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
        except (BlockingIOError, InterruptedError, OSError):
            return False
        return sent == len(data)

    def _drop(self, connection: _Connection, why: str | None) -> None:
        if why is not None:
            log.warning("fd channel: dropped a connection of pid %d uid %d: it %s", connection.pid, connection.uid,
                        why)
        if self._connections.pop(connection.sock.fileno(), None) is not None:
            left = self._per_peer.get(connection.peer, 0) - 1
            if left > 0:
                self._per_peer[connection.peer] = left
            else:
                self._per_peer.pop(connection.peer, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(connection.sock)
        connection.sock.close()
        connection.charge.release()
