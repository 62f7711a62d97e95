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
once: beyond them new ones are closed at once.
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

from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.errors import CuctxError
from cuctxd.protos.fd_channel import REQUEST_BYTES, encode_reply, parse_request, socket_address

log = logging.getLogger(__name__)

#: Seconds a connection may sit between two requests before it is closed (the client reconnects).
IDLE_TIMEOUT = 60.0
#: Default of ``max_fd_connections``.
DEFAULT_MAX_FD_CONNECTIONS = 256
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    pid: int
    uid: int
    received: bytearray = field(default_factory=bytearray)
    #: When the connection closes unless a request completes (or, once one did, a new one starts).
    deadline: float = 0.0
    served: bool = False


class SideChannel:
    """The fd channel's listening sockets and thread; :meth:`start` binds and starts, :meth:`stop` ends both."""

    def __init__(self, paths: list[str], tickets: TicketBook, *, handshake_timeout: float,
                 max_connections: int = DEFAULT_MAX_FD_CONNECTIONS) -> None:
        """``paths``: one socket per ipc:// endpoint, in its directory; whoever assembles the daemon clears
        stale files there before :meth:`start` and sets the modes after (as for the endpoint itself)."""
        self.paths = paths
        self.tickets = tickets
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._connections: dict[int, _Connection] = {}
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = threading.Event()
        self._refused_logged = 0.0
        self.thread = threading.Thread(target=self._run, name="cuctxd-fd-channel", daemon=True)

    # --- any thread -------------------------------------------------------------------

    def start(self) -> None:
        for path in self.paths:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(socket_address(path))
                listener.listen(64)
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
        """For ``status``: open connections, their cap, and the tickets waiting (any thread)."""
        return {"connections": len(self._connections), "max_connections": self.max_connections,
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
                        self._accept(key.fileobj)  # type: ignore[arg-type]
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

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._connections) >= self.max_connections:
            sock.close()
            now = time.monotonic()
            if now - self._refused_logged > 10.0:
                self._refused_logged = now
                log.warning("fd channel: %d connections open (max_fd_connections): refusing new ones",
                            len(self._connections))
            return
        sock.setblocking(False)
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        connection = _Connection(sock, pid, uid, deadline=time.monotonic() + self.handshake_timeout)
        self._connections[sock.fileno()] = connection
        self._selector.register(sock, selectors.EVENT_READ, connection)

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
        data = encode_reply(body)
        try:
            sent = socket.send_fds(connection.sock, [data], fds) if fds else connection.sock.send(data)
        except (BlockingIOError, InterruptedError, OSError):
            return False
        return sent == len(data)

    def _drop(self, connection: _Connection, why: str | None) -> None:
        if why is not None:
            log.warning("fd channel: dropped a connection of pid %d uid %d: it %s", connection.pid, connection.uid,
                        why)
        self._connections.pop(connection.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(connection.sock)
        connection.sock.close()
