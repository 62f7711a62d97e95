"""Mapping a sim-backend share in this process: the allocation's shared-memory file, mmapped."""

from __future__ import annotations

import mmap
import os

from cuctxd.protos.errors import NotFound, NotShareable
from cuctxd.protos.records import ShareDescriptor
from cuctxd.protos.sim_ipc import decode_handle


class SimMapping:
    """The same bytes the daemon's sim device holds, as a writable memoryview."""

    def __init__(self, descriptor: ShareDescriptor) -> None:
        try:
            path = decode_handle(descriptor.ipc_handle)
        except ValueError as exc:
            raise NotShareable(f"share {descriptor.share_id}: {exc}") from exc
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise NotFound(f"share {descriptor.share_id}: its memory is gone (stale descriptor)") from exc
        except PermissionError as exc:
            raise NotShareable(f"share {descriptor.share_id}: no permission to map {path}") from exc
        try:
            self._map = mmap.mmap(fd, descriptor.size)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        self._map.close()
