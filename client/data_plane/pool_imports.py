"""This process's imported memory pools, shared by every client in it: one import per daemon pool.

Opening a ``"pool"`` share imports its pool the first time (``cuMemPoolImportFromShareableHandle``
on the fd the daemon sends through the fd channel; a memfd mapping on the sim) and
then only the pointer (``cuMemPoolImportPointer``, about 2 us). A pool stays imported
while any of its buffers is mapped, and afterwards among the :data:`KEEP_IDLE` most
recently used, so reopening is cheap; older idle imports are closed. Any thread.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

from cuctxd.client.data_plane.openings import Opening
from cuctxd.protos.errors import NotShareable
from cuctxd.protos.records import ShareDescriptor

#: Imported pools kept while none of their buffers is mapped.
KEEP_IDLE = 32


def _import_pool(descriptor: ShareDescriptor, fd: int) -> Any:
    if descriptor.backend == "sim":
        from cuctxd.client.data_plane.ipc_sim import SimPoolImport

        return SimPoolImport(fd, descriptor.device_uuid)
    if descriptor.backend == "cuda":
        from cuctxd.client.data_plane.ipc_cuda import CudaPoolImport

        return CudaPoolImport(fd, descriptor.device_uuid)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")


class PoolImports:
    """Imported pools by pool id, with how many mapped buffers use each; see the module docstring."""

    def __init__(self, keep_idle: int = KEEP_IDLE) -> None:
        self._lock = threading.Lock()
        self._keep_idle = keep_idle
        self._pools: dict[str, Any] = {}
        self._users: dict[str, int] = {}
        #: Imported buffers by (pool id, export data): the mapping and how many openings share it.
        self._buffers: dict[tuple[str, bytes], list[Any]] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()

    def has(self, pool_id: str) -> bool:
        with self._lock:
            return pool_id in self._pools

    def map(self, descriptor: ShareDescriptor, fd: int | None) -> Opening:
        """Map the share's buffer, importing its pool from ``fd`` (closed here) unless already imported."""
        pool_id = descriptor.pool_id
        key = (pool_id, descriptor.export_data)
        with self._lock:
            shared = self._buffers.get(key)
            if shared is not None:
                shared[1] += 1
                if fd is not None:
                    os.close(fd)
                return Opening(self, key, shared[0])
            pool = self._pools.get(pool_id)
            try:
                if pool is None:
                    if fd is None:
                        raise NotShareable(f"pool {pool_id} of share {descriptor.share_id} is not imported in "
                                           "this process; open the share again")
                    pool = self._pools[pool_id] = _import_pool(descriptor, fd)
            finally:
                if fd is not None:
                    os.close(fd)
            self._users[pool_id] = self._users.get(pool_id, 0) + 1
            self._idle.pop(pool_id, None)
            try:  # under the lock: a second opening must find this import, not make its own
                mapping = pool.import_pointer(descriptor.export_data, descriptor.size)
            except BaseException:
                for idle in self._release_locked(pool_id):
                    idle.close()
                raise
            self._buffers[key] = [mapping, 1]
        return Opening(self, key, mapping)

    def unmap(self, key: tuple[str, bytes]) -> None:
        """One opening of a buffer fewer; the last one frees its import and releases the pool."""
        with self._lock:
            shared = self._buffers[key]
            shared[1] -= 1
            if shared[1]:
                return
            del self._buffers[key]
        try:
            shared[0].close()
        finally:
            self.release(key[0])

    def release(self, pool_id: str) -> None:
        """One imported buffer of the pool fewer; idle pools beyond :data:`KEEP_IDLE` are closed."""
        with self._lock:
            closing = self._release_locked(pool_id)
        for pool in closing:
            pool.close()

    def _release_locked(self, pool_id: str) -> list[Any]:
        closing = []
        self._users[pool_id] -= 1
        if self._users[pool_id] == 0:
            del self._users[pool_id]
            self._idle[pool_id] = None
            while len(self._idle) > self._keep_idle:
                oldest, _ = self._idle.popitem(last=False)
                closing.append(self._pools.pop(oldest))
        return closing


#: The process's imports: a pool is imported once whichever client opens its buffers.
POOL_IMPORTS = PoolImports()
