"""Stopping a listening endpoint from taking new connections without closing it, and letting it again.

``zmq_unbind`` would do the first, but it also closes every connection that
came in through the endpoint, the clients already served included. So the
listener stays open and the kernel is kept from queueing new connections to
it: an ipc:// socket file is moved into a private directory next to it (a
client's ``connect`` finds no file; the connections made stay), a tcp://
listener gets a socket filter that drops every packet (a client's SYN goes
unanswered and is retried). Called on the thread that owns the ROUTER
(:class:`~cuctxd.daemon.intake.connections.ListenerGuard`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import socket
import struct
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: Linux socket options (asm-generic/socket.h); Python's socket module does not name them.
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
#: One classic BPF instruction, ``ret #0``: keep no byte of any packet.
_DROP_ALL = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("HBBI", 0x06, 0, 0, 0))
#: How the directory a paused ipc:// socket file waits in is named (``tempfile.mkdtemp``'s 8 characters after
#: the prefix): what a daemon killed while paused leaves, and the next one removes at start
#: (:func:`cuctxd.daemon.service.endpoint.clear_stale_paused`).
PAUSED_PREFIX = ".paused-"
PAUSED_NAME = re.compile(re.escape(PAUSED_PREFIX) + r"[a-z0-9_]{8}")


class IpcListener:
    """An ipc:// endpoint's socket file; paused by moving it aside, in the same directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._parked: Path | None = None

    def pause(self) -> None:
        """Move the socket file into a new directory only this user may enter (mode 0700)."""
        parked = Path(tempfile.mkdtemp(prefix=PAUSED_PREFIX, dir=self.path.parent)) / self.path.name
        try:
            os.rename(self.path, parked)
        except OSError:
            os.rmdir(parked.parent)
            raise
        self._parked = parked

    def resume(self) -> None:
        """Put the socket file back (never over a file someone put there meanwhile: FileExistsError)."""
        parked = self._parked
        assert parked is not None
        os.link(parked, self.path)
        self._parked = None
        self._discard(parked)

    def close(self) -> None:
        """At exit: remove the moved-aside file, if paused (the daemon removes the socket file itself)."""
        if self._parked is not None:
            self._discard(self._parked)
            self._parked = None

    @staticmethod
    def _discard(parked: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            parked.unlink()
        os.rmdir(parked.parent)


class TcpListener:
    """A tcp:// endpoint's listening socket (libzmq's descriptor, told by the monitor); paused by a
    socket filter that drops every packet, SYNs and handshakes' last ACKs included."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def pause(self) -> None:
        program = struct.pack("HP", 1, ctypes.addressof(_DROP_ALL))  # struct sock_fprog, native layout
        with self._socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)

    def resume(self) -> None:
        with self._socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)

    def close(self) -> None:
        """Nothing to undo: libzmq closes the descriptor."""

    def _socket(self) -> socket.socket:
        """A second descriptor of the same socket, closed after use (libzmq's stays its own)."""
        return socket.socket(fileno=os.dup(self.fd))


Listener = IpcListener | TcpListener
