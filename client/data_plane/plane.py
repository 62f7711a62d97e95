"""A client's side of the data plane: its fd channel and its staging rings.

Made after ``hello`` when the daemon offers an fd channel (``hello``'s
``fd_channel``: only beside an ipc:// endpoint on this host); absent otherwise,
and then every transfer takes the socket, as over tcp://. A staging ring is a
host buffer (:mod:`cuctxd.client.data_plane.host_buffers`) per device that large
``write``/``read_into`` calls copy through (:mod:`cuctxd.client.data_plane.transfers`),
made on first use; it counts against the session's ``host_memory_per_session``.
Which thread may call: the client's callers, under the client's own serialisation.
"""

from __future__ import annotations

import os
from typing import Any

from cuctxd.client.wire.fd_channel import FdChannel
from cuctxd.protos.errors import BadRequest


class DataPlane:
    """The fd channel of one client, and its staging rings by device."""

    def __init__(self, fd_channel: str, timeout: float) -> None:
        self.channel = FdChannel(fd_channel, timeout)
        #: Device -> its staging ring, or None once making one failed (the socket carries the bytes then).
        self.rings: dict[int, Any] = {}

    def receive_fd(self, ticket: str) -> int:
        """The one fd a ticket stands for (the caller owns it)."""
        fds, _ = self.channel.fetch(ticket)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise BadRequest(f"the fd channel sent {len(fds)} fds for a ticket of one")
        return fds[0]

    def close(self) -> None:
        """Unmap the rings here (the daemon frees its side with the session) and close the channel."""
        for ring in self.rings.values():
            if ring is not None:
                ring.unmap()
        self.rings.clear()
        self.channel.close()
