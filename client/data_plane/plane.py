"""A client's side of the data plane: its fd channel and its staging rings.

Made after ``hello`` when the daemon offers an fd channel (``hello``'s
``fd_channel``: only beside an ipc:// endpoint on this host, :meth:`DataPlane.offered`); absent otherwise,
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
from cuctxd.protos.errors import BadRequest, NotShareable
from cuctxd.protos.host import host_identity


class DataPlane:
    """The fd channel of one client, and its staging rings by device."""

    def __init__(self, fd_channel: str, timeout: float) -> None:
        self.channel = FdChannel(fd_channel, timeout)
        #: Device -> its staging ring, or None once making one failed (the socket carries the bytes then).
        self.rings: dict[int, Any] = {}

    @classmethod
    def offered(cls, hello: dict[str, Any], timeout: float) -> DataPlane | None:
        """The data plane when ``hello``'s answer names an fd channel this process can reach, else None."""
        path = hello.get("fd_channel")
        return cls(path, timeout) if path and hello.get("host") == host_identity() else None

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


def checked(plane: DataPlane | None, endpoint: str, required: bool) -> DataPlane | None:
    """A client's ``plane`` (its ``data_plane()``): None when it has none, or
    :class:`~cuctxd.protos.errors.NotShareable` when ``required``."""
    if plane is None and required:
        raise NotShareable(f"the daemon at {endpoint} offers no fd channel to this process (it has one "
                           "only beside an ipc:// endpoint on this host): connect over ipc:// to map "
                           "pool shares or host buffers")
    return plane
