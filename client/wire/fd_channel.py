"""The client's side of the fd channel: redeeming tickets for file descriptors (PROTOCOL.md, "The fd channel").

One Unix stream connection per client, made on first use and kept (the daemon
closes it after a minute idle; the next fetch reconnects once). Thread-safe:
one lock around each request and its reply.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

from cuctxd.protos.errors import BadRequest, ConnectionLost, CuctxError, error_from_wire
from cuctxd.protos.fd_channel import MAX_FDS, decode_reply, encode_request, reply_length, socket_address

#: Seconds between two attempts to connect while the daemon's queue of connections is full (a Unix socket
#: with a timeout answers ``EAGAIN`` at once then, where a blocking one would wait).
CONNECT_RETRY_S = 0.002


class FdChannel:
    """A client's connection to the fd channel at ``path``; ``timeout``: seconds a fetch may wait."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        #: File descriptors received through this channel since it was made.
        self.fds_received = 0

    def fetch(self, ticket: str) -> tuple[list[int], dict[str, Any]]:
        """The fds a ticket stands for (the caller owns and closes them) and the daemon's ``info`` on them.
        Raises the daemon's error for a ticket it refuses, :class:`ConnectionLost` when the channel cannot
        be reached, :class:`BadRequest` for a reply that is not one."""
        request = encode_request(ticket)
        with self._lock:
            for attempt in (1, 2):
                fresh = self._sock is None
                sock = self._connect()
                try:
                    sock.sendall(request)
                    fds, info = self._receive(sock)
                    self.fds_received += len(fds)
                    return fds, info
                except (BrokenPipeError, ConnectionResetError, EOFError) as lost:
                    refusal = _refusal(sock) if fresh and not isinstance(lost, EOFError) else None
                    self._close()
                    if refusal is not None:  # a daemon over a limit answers a new connection so and closes it
                        raise refusal from None
                    if fresh or attempt == 2:  # a new connection that fails is not an idle one timed out
                        raise ConnectionLost(f"the fd channel at {self.path} closed the connection",
                                             "fd_channel") from None
                except BaseException:
                    self._close()
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> socket.socket:
        if self._sock is None:
            deadline = time.monotonic() + self.timeout
            while True:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(socket_address(self.path))
                    break
                except BlockingIOError as error:  # the daemon's queue of connections to accept is full
                    sock.close()
                    if time.monotonic() >= deadline:
                        raise ConnectionLost(f"cannot reach the daemon's fd channel at {self.path}: {error}",
                                             "fd_channel") from None
                    time.sleep(CONNECT_RETRY_S)
                except OSError as error:
                    sock.close()
                    raise ConnectionLost(f"cannot reach the daemon's fd channel at {self.path}: {error}",
                                         "fd_channel") from None
            self._sock = sock
        return self._sock

    @staticmethod
    def _receive(sock: socket.socket) -> tuple[list[int], dict[str, Any]]:
        header, fds, flags, _ = socket.recv_fds(sock, 4, MAX_FDS)
        try:
            if not header:
                raise EOFError
            if flags & socket.MSG_CTRUNC:
                raise BadRequest("the fd channel's reply carried more fds than it may")
            header = _receive_exactly(sock, 4, header)
            reply = decode_reply(_receive_exactly(sock, reply_length(header)))
        except ValueError as error:
            _close_all(fds)
            raise BadRequest(f"the fd channel sent something that is not a reply: {error}") from None
        except BaseException:
            _close_all(fds)
            raise
        if "error" in reply:
            _close_all(fds)
            raise error_from_wire(reply["error"], "fd_channel")
        if reply.get("fds") != len(fds):
            _close_all(fds)
            raise BadRequest(f"the fd channel announced {reply.get('fds')} fds and sent {len(fds)}")
        return fds, dict(reply.get("info") or {})

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()


def _refusal(sock: socket.socket) -> CuctxError | None:
    """The error a daemon left on a connection it closed at once (over one of its limits), if it did."""
    try:
        sock.settimeout(min(sock.gettimeout() or 1.0, 1.0))
        FdChannel._receive(sock)
    except CuctxError as error:
        return error
    except (OSError, EOFError):
        return None
    return None


def _receive_exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    """``start`` completed to ``size`` bytes from ``sock``; EOFError if it closes first."""
    data = start
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise EOFError
        data += more
    return data


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
