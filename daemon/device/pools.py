"""Stream-ordered memory pools of one device, one per context, and the two kinds of device memory.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. Where the device can export
pools as POSIX file descriptors (``CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES``),
every context's pool is made IPC-capable, so every buffer can be shared: a
consumer imports the pool once (its fd goes out through the fd channel) and then
each buffer from 64 bytes of ``cuMemPoolExportPointer``. Elsewhere pools are
private and ``shareable=True`` buffers come from ``cuMemAlloc`` (legacy
``cuIpcGetMemHandle``). So do buffers above :data:`~cuctxd.protos.limits.POOL_BUFFER_MAX`, on every
backend (why: that constant's comment). One object per kind of memory pairs allocate with free and
export (:class:`PoolMemory`, :class:`LegacyMemory`), instead of branches on a flag.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.backends.base import Driver, Pool, Stream
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import SessionContext
from cuctxd.protos.errors import NotShareable


@dataclass(eq=False)
class PoolEntry:
    """A context's pool; ``pool_id`` (unique per daemon run) is what importers key their import by."""

    pool: Pool
    pool_id: str
    ipc: bool


class Pools:
    """The pools of this device's contexts, made on a context's first pool allocation."""

    def __init__(self, driver: Driver, device: int, current: CurrentContext) -> None:
        self.driver = driver
        self.device = device
        self.current = current
        #: Whether pools here are made IPC-capable (asked of the driver once).
        self.ipc = driver.pool_ipc_supported(device)
        #: By context id.
        self.entries: dict[int, PoolEntry] = {}

    def of(self, context: SessionContext) -> PoolEntry:
        entry = self.entries.get(context.context_id)
        if entry is None:
            self.current.activate(context)
            pool = self.driver.mem_pool_create(self.device, ipc=self.ipc)
            entry = self.entries[context.context_id] = PoolEntry(pool, secrets.token_hex(12), self.ipc)
        return entry

    def export_fd(self, context: SessionContext) -> int:
        """A new fd of ``context``'s pool for an importer (the caller owns it)."""
        entry = self.of(context)
        if not entry.ipc:
            raise NotShareable(f"device {self.device}'s pools cannot be exported")
        return self.driver.mem_pool_export_fd(entry.pool)

    def forget(self, context: SessionContext) -> None:
        """Before a context goes away (it is current): destroy its pool."""
        entry = self.entries.pop(context.context_id, None)
        if entry is not None:
            self.driver.mem_pool_destroy(entry.pool)

    def trim(self) -> None:
        """Give cached pool memory back to the device (after a session ends, or on OOM)."""
        for entry in self.entries.values():
            self.driver.mem_pool_trim(entry.pool, 0)

    def cached(self) -> int:
        """Bytes the pools hold for reuse: free for the sessions, though the driver counts them used."""
        return sum(self.driver.mem_pool_cached(entry.pool) for entry in self.entries.values())


class PoolMemory:
    """Stream-ordered memory from the context's pool (``cuMemAllocFromPoolAsync``/``cuMemFreeAsync``
    on the legacy stream); exportable when the device's pools are."""

    def __init__(self, driver: Driver, pools: Pools) -> None:
        self.driver = driver
        self.pools = pools
        self.exportable = pools.ipc

    def allocate(self, context: SessionContext, size: int, stream: Stream | None = None) -> int:
        return self.driver.mem_alloc_from_pool(size, self.pools.of(context).pool, stream)

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        self.driver.mem_free_async(ptr, stream)

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        """Share descriptor fields naming the buffer (its context current; only when :attr:`exportable`)."""
        return {"mechanism": "pool", "pool_id": self.pools.of(context).pool_id,
                "export_data": self.driver.mem_pool_export_pointer(ptr), "ipc_handle": b""}


class LegacyMemory:
    """``cuMemAlloc``/``cuMemFree`` memory, exported with ``cuIpcGetMemHandle``: where pools cannot export."""

    exportable = True

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def allocate(self, context: SessionContext, size: int, stream: Stream | None = None) -> int:
        """``cuMemAlloc``: synchronous, so any stream is already in order."""
        return self.driver.mem_alloc(size)

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        self.driver.mem_free(ptr)

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        return {"mechanism": "ipc", "ipc_handle": self.driver.ipc_get_mem_handle(ptr)}
