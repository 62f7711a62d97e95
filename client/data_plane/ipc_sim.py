"""Mapping a sim-backend share in this process: a block of its imported pool's memfd, a VMM allocation's
memfd (from the fd channel), or (legacy) the allocation's own memfd opened by its ``/proc`` path, mmapped."""

from __future__ import annotations

import mmap
import os

from cuctxd.protos.errors import NotFound, NotShareable
from cuctxd.protos.records import ShareDescriptor
from cuctxd.protos.sim_ipc import decode_handle, decode_pool_pointer


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


class SimVmmMapping:
    """A ``"vmm"`` sim share: its memfd (from the fd channel; the caller still closes the fd) mapped whole, shared;
    ``view`` is the buffer's ``size`` bytes of it."""

    def __init__(self, descriptor: ShareDescriptor, fd: int) -> None:
        length = os.fstat(fd).st_size
        if length != descriptor.allocation_size or descriptor.size > length:
            raise NotShareable(f"share {descriptor.share_id}: its memory is {length} bytes, the descriptor says "
                               f"{descriptor.allocation_size}")
        self._map = mmap.mmap(fd, length)
        self.view = memoryview(self._map)[:descriptor.size]

    def close(self) -> None:
        self.view.release()
        self._map.close()


class SimPoolImport:
    """A sim pool imported into this process: its memfd (from the fd channel; the caller still closes the
    fd) mapped whole, shared. Each buffer is a slice of it (:meth:`import_pointer`)."""

    def __init__(self, fd: int, device_uuid: str = "") -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        self._view = memoryview(self._map)

    def import_pointer(self, export_data: bytes, size: int) -> SimPoolMapping:
        try:
            offset, block = decode_pool_pointer(export_data)
        except ValueError as exc:
            raise NotShareable(f"a sim pool share: {exc}") from exc
        if size > block or offset + size > len(self._view):
            raise NotShareable(f"a sim pool share of {size} bytes does not fit its block ({block} at {offset})")
        return SimPoolMapping(self._view[offset:offset + size])

    def close(self) -> None:
        """Unmap; BufferError while a buffer's view is still alive (close the mappings first)."""
        self._view.release()
        self._map.close()


class SimPoolMapping:
    """One buffer of an imported sim pool: ``view`` (writable) until :meth:`close`."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def close(self) -> None:
        self.view.release()
