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

from cuctxd.protos.errors import NotShareable
from cuctxd.protos.records import ShareDescriptor

#: Imported pools kept while none of their buffers is mapped.
KEEP_IDLE = 32


def _import_pool(descriptor: ShareDescriptor, fd: int) -> Any:
    if descriptor.backend == "sim":
        from cuctxd.client.ipc_sim import SimPoolImport

        return SimPoolImport(fd, descriptor.device_uuid)
    if descriptor.backend == "cuda":
        from cuctxd.client.ipc_cuda import CudaPoolImport

        return CudaPoolImport(fd, descriptor.device_uuid)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")


class PoolMapping:
    """One buffer of an imported pool: ``ptr`` (cuda) or ``view`` (sim), and :meth:`close`."""

    def __init__(self, imports: PoolImports, pool_id: str, mapping: Any) -> None:
        self._imports = imports
        self._pool_id = pool_id
        self._mapping = mapping

    @property
    def ptr(self) -> int:
        return int(self._mapping.ptr)

    @property
    def view(self) -> memoryview:
        view: memoryview = self._mapping.view
        return view

    def close(self) -> None:
        try:
            self._mapping.close()
        finally:
            self._imports.release(self._pool_id)


class PoolImports:
    """Imported pools by pool id, with how many mapped buffers use each; see the module docstring."""

    def __init__(self, keep_idle: int = KEEP_IDLE) -> None:
        self._lock = threading.Lock()
        self._keep_idle = keep_idle
        self._pools: dict[str, Any] = {}
        self._users: dict[str, int] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()

    def has(self, pool_id: str) -> bool:
        with self._lock:
            return pool_id in self._pools

    def map(self, descriptor: ShareDescriptor, fd: int | None) -> PoolMapping:
        """Map the share's buffer, importing its pool from ``fd`` (closed here) unless already imported."""
        pool_id = descriptor.pool_id
        with self._lock:
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
        try:
            mapping = pool.import_pointer(descriptor.export_data, descriptor.size)
        except BaseException:
            self.release(pool_id)
            raise
        return PoolMapping(self, pool_id, mapping)

    def release(self, pool_id: str) -> None:
        """One mapped buffer of the pool fewer; idle pools beyond :data:`KEEP_IDLE` are closed."""
        closing = []
        with self._lock:
            self._users[pool_id] -= 1
            if self._users[pool_id] == 0:
                del self._users[pool_id]
                self._idle[pool_id] = None
                while len(self._idle) > self._keep_idle:
                    oldest, _ = self._idle.popitem(last=False)
                    closing.append(self._pools.pop(oldest))
        for pool in closing:
            pool.close()


#: The process's imports: a pool is imported once whichever client opens its buffers.
POOL_IMPORTS = PoolImports()
