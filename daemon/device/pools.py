"""Stream-ordered memory pools of one device and the four kinds of device memory.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. No memory that holds one tenant's
bytes is ever handed to another (PROTOCOL.md, section 7, "Which memory can be shared"):

* **Private pools** (:class:`PrivatePoolMemory`): one per context *and uid*, never
  IPC-capable, never exported. The fast path for every buffer that is not
  ``shareable``; a freed block is reused only by sessions of the same uid.
* **VMM memory** (:class:`VmmMemory`): every ``shareable`` buffer, where the device has VMM with
  POSIX fds: ``cuMemCreate`` of its size rounded up to the device's VMM granularity (2 MiB), mapped
  with ``cuMemAddressReserve``/``cuMemMap``/``cuMemSetAccess``. An fd of it
  (``cuMemExportToShareableHandle``, made for each ``open_shared`` with ``pool_fd`` and for parking,
  never held per buffer) names this one allocation, and keeps it alive without the daemon: such a
  share can be parked.
* **Pools of their own** (:class:`OwnPoolMemory`): where the device has no VMM but can export
  pools as POSIX file descriptors (``CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES``), a
  ``shareable`` buffer of at most :data:`~cuctxd.protos.limits.POOL_BUFFER_MAX` is the only
  allocation of an IPC-capable pool made for it and destroyed with it. The pool's fd (what
  ``open_shared`` with ``pool_fd`` hands out) then reaches that buffer and nothing else: with CUDA,
  an importer that holds a pool's fd must be assumed able to forge ``CUmemPoolPtrExportData`` for
  any allocation of the pool (tests/gpu/test_pool_import_probe.py probes it); on the sim, the fd is
  the pool's whole memfd. Costly: a pool holds an fd in the daemon, and on an H100 32 MiB of device
  memory, whatever the buffer's size.
* **Legacy memory** (:class:`LegacyMemory`): ``cuMemAlloc``, exported with
  ``cuIpcGetMemHandle``, for buffers above :data:`~cuctxd.protos.limits.POOL_BUFFER_MAX`
  (why: that constant's comment) that are not ``shareable``, and for ``shareable`` ones where the
  device has neither VMM nor pools that export (above ``POOL_BUFFER_MAX``: no VMM). Sizes are
  rounded up to :data:`IPC_GRANULARITY`: the CUDA programming guide warns that ``cuMemAlloc`` may
  sub-allocate smaller allocations from one block, and that the IPC API then shares the whole block
  with its neighbours.

Each kind says what a buffer of it costs the device (:meth:`footprint`): what the session quota
charges. Memory that was shared is scrubbed (``cuMemsetD8`` to 0) before it is freed
(:meth:`cuctxd.daemon.device.sharing.Sharing.settle`), so the next user of those
bytes never reads them. One object per kind of memory pairs allocate with free and
export, instead of branches on a flag.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.backends.base import Driver, Pool, Stream
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import SessionContext
from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.errors import NotShareable

#: What memory shared with other processes is rounded up to (legacy buffers, a pool of one's own's bound):
#: CUDA's allocation granularity on current GPUs, so no other allocation shares the block.
IPC_GRANULARITY = 2 << 20


def round_to_granularity(size: int) -> int:
    return -(-size // IPC_GRANULARITY) * IPC_GRANULARITY


@dataclass(eq=False)
class PoolEntry:
    """A pool; ``pool_id`` (unique per daemon run) is what importers key their import by."""

    pool: Pool
    pool_id: str
    ipc: bool
    #: The context it was made in (``cuCtxGetId``): it goes before that context does.
    context_id: int = 0
    #: An adopted pool (imported from its parked fd, :mod:`cuctxd.daemon.device.parking`): that fd, which
    #: importers get copies of, and its one buffer's export data, as the pool's first owner exported them.
    fd: int = -1
    export_data: bytes = b""
    #: The fds the pool holds in this process (:attr:`Driver.ipc_pool_fds`), in the fd budget until it goes.
    charge: FdCharge | None = None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.charge is not None:
            self.charge.release()


class Pools:
    """The device's private pools (by context and uid, made on first use) and its pools of their own
    (by the pointer of their one buffer)."""

    def __init__(self, driver: Driver, device: int, current: CurrentContext, budget: FdBudget) -> None:
        """``budget``: the daemon's fd budget, which each pool of its own's fds count in."""
        self.driver = driver
        self.device = device
        self.current = current
        self.budget = budget
        #: Whether ``shareable`` buffers can have an exportable pool of their own (asked of the driver once).
        self.ipc = driver.pool_ipc_supported(device)
        #: Private pools by (context id, uid); uid None: sessions whose uid the daemon cannot tell (tcp://).
        self.entries: dict[tuple[int, int | None], PoolEntry] = {}
        #: Pools of their own by the pointer of their only buffer.
        self.own: dict[int, PoolEntry] = {}

    def of(self, context: SessionContext, uid: int | None) -> PoolEntry:
        """The private pool of ``context`` for sessions of ``uid``."""
        key = (context.context_id, uid)
        entry = self.entries.get(key)
        if entry is None:
            self.current.activate(context)
            pool = self.driver.mem_pool_create(self.device, ipc=False)
            entry = self.entries[key] = PoolEntry(pool, secrets.token_hex(12), False, context.context_id)
        return entry

    def allocate_own(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        """``size`` bytes from a new IPC-capable pool made for them alone (``context`` current). The pool's fds count
        against ``session``'s share of the fd budget until it is destroyed: :class:`LimitExceeded` (nothing made)
        when they would pass it."""
        charge = self.budget.charge(self.driver.ipc_pool_fds, "a shareable buffer's pool of its own",
                                    session.fd_peer or session.token, session.token)
        try:
            pool = self.driver.mem_pool_create(self.device, ipc=True, max_size=round_to_granularity(size))
            try:
                ptr = self.driver.mem_alloc_from_pool(size, pool, stream)
            except BaseException:
                self.driver.mem_pool_destroy(pool)
                raise
        except BaseException:
            charge.release()
            raise
        self.own[ptr] = PoolEntry(pool, secrets.token_hex(12), True, context.context_id, charge=charge)
        return ptr

    def adopt(self, ptr: int, pool: Pool, context_id: int, fd: int, export_data: bytes) -> PoolEntry:
        """Take an imported pool (fd owned from now on) with its one imported buffer at ``ptr`` as a pool of its own."""
        entry = self.own[ptr] = PoolEntry(pool, secrets.token_hex(12), True, context_id, fd, export_data)
        return entry

    def free_own(self, ptr: int, stream: Stream | None) -> None:
        """Free a pool of its own's buffer in stream order and destroy the pool (the driver lets its
        memory go once the free has happened)."""
        entry = self.own.pop(ptr)
        try:
            self.driver.mem_free_async(ptr, stream)
            self.driver.mem_pool_destroy(entry.pool)
        finally:
            entry.close()

    def export_fd(self, ptr: int) -> int:
        """A new fd of the pool of its own of the buffer at ``ptr``, for an importer (the caller owns it)."""
        entry = self.own.get(ptr)
        if entry is None:
            raise NotShareable(f"this buffer on device {self.device} has no pool of its own to export")
        if entry.fd >= 0:
            return os.dup(entry.fd)
        return self.driver.mem_pool_export_fd(entry.pool)

    def forget(self, context: SessionContext) -> None:
        """Before a context goes away (it is current): destroy its pools."""
        for key in [key for key in self.entries if key[0] == context.context_id]:
            self.driver.mem_pool_destroy(self.entries.pop(key).pool)
        for ptr in [ptr for ptr, entry in self.own.items() if entry.context_id == context.context_id]:
            entry = self.own.pop(ptr)
            entry.close()
            self.driver.mem_pool_destroy(entry.pool)

    def trim(self) -> None:
        """Give cached pool memory back to the device (after a session ends, or on OOM)."""
        for entry in self.entries.values():
            self.driver.mem_pool_trim(entry.pool, 0)

    def cached(self) -> int:
        """Bytes the private pools hold for reuse: free for the sessions, though the driver counts them used."""
        return sum(self.driver.mem_pool_cached(entry.pool) for entry in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries) + len(self.own)


class PrivatePoolMemory:
    """Stream-ordered memory from the private pool of the context and the session's uid
    (``cuMemAllocFromPoolAsync``/``cuMemFreeAsync`` on the legacy stream, or the stream given); never
    exported."""

    exportable = False

    def __init__(self, driver: Driver, pools: Pools) -> None:
        self.driver = driver
        self.pools = pools

    def allocate(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        return self.driver.mem_alloc_from_pool(size, self.pools.of(context, session.uid).pool, stream)

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        self.driver.mem_free_async(ptr, stream)

    def footprint(self, size: int) -> int:
        """The size asked: the pool's block is that, rounded to its alignment."""
        return size

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        raise NotShareable("a buffer from a private pool cannot be exported")

    def scrub(self, ptr: int, size: int) -> None:
        self.driver.memset_d8(ptr, 0, size)


class OwnPoolMemory:
    """A ``shareable`` buffer in an IPC-capable pool of its own (see the module docstring)."""

    exportable = True

    def __init__(self, driver: Driver, pools: Pools) -> None:
        self.driver = driver
        self.pools = pools

    def allocate(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        return self.pools.allocate_own(context, size, stream, session)

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        self.pools.free_own(ptr, stream)

    def footprint(self, size: int) -> int:
        """The pool's bound, :data:`IPC_GRANULARITY` rounded (the driver may reserve more for a pool)."""
        return round_to_granularity(size)

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        """Share descriptor fields naming the buffer (its context current)."""
        entry = self.pools.own[ptr]
        return {"mechanism": "pool", "pool_id": entry.pool_id,
                "export_data": entry.export_data or self.driver.mem_pool_export_pointer(ptr), "ipc_handle": b""}

    def scrub(self, ptr: int, size: int) -> None:
        """``cuMemsetD8`` of the buffer to 0 on the legacy stream (its context current), before its free."""
        self.driver.memset_d8(ptr, 0, size)


class LegacyMemory:
    """``cuMemAlloc``/``cuMemFree`` memory, exported with ``cuIpcGetMemHandle``, rounded up to
    :data:`IPC_GRANULARITY` so that its IPC handle reaches no other allocation."""

    exportable = True

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def allocate(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        """``cuMemAlloc``: synchronous, so any stream is already in order."""
        return self.driver.mem_alloc(round_to_granularity(size))

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        self.driver.mem_free(ptr)

    def footprint(self, size: int) -> int:
        return round_to_granularity(size)

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        return {"mechanism": "ipc", "ipc_handle": self.driver.ipc_get_mem_handle(ptr)}

    def scrub(self, ptr: int, size: int) -> None:
        """The whole allocation, padding included: an importer maps all of it."""
        self.driver.memset_d8(ptr, 0, round_to_granularity(size))


class VmmMemory:
    """``shareable`` memory that an fd can name (see the module docstring): one ``cuMemCreate`` allocation per
    buffer, of the device's granularity. Keeps the mapped size of each of its buffers, and no fd of any
    (worker thread only)."""

    exportable = True

    def __init__(self, driver: Driver, device: int, budget: FdBudget) -> None:
        """``budget``: the daemon's fd budget, which counts what the backend keeps once a buffer is exported."""
        self.driver = driver
        self.device = device
        self.budget = budget
        #: Whether the device has VMM with POSIX fds (asked of the driver once).
        self.supported = driver.vmm_supported(device)
        #: Mapped bytes by the address of each buffer (its size rounded up to the granularity).
        self.sizes: dict[int, int] = {}
        #: Buffers allocated here and never exported yet (adopted ones came with their fd).
        self.unexported: set[int] = set()
        #: By buffer, the fds the backend keeps from its first export on (:attr:`Driver.vmm_export_fds`).
        self.charges: dict[int, FdCharge] = {}

    def rounded(self, size: int) -> int:
        granularity = self.driver.vmm_granularity(self.device)
        return -(-size // granularity) * granularity

    def footprint(self, size: int) -> int:
        """The whole allocation: ``size`` rounded up to the granularity (2 MiB for a 4 KiB buffer)."""
        return self.rounded(size)

    def allocate(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        """``cuMemCreate`` + map: synchronous, so any stream is already in order. No fd is held for it."""
        mapped = self.rounded(size)
        ptr = self.driver.vmm_alloc(self.device, mapped)
        self.sizes[ptr] = mapped
        self.unexported.add(ptr)
        return ptr

    def adopt(self, fd: int, size: int) -> int:
        """The allocation ``fd`` names (the caller keeps ``fd``), imported and mapped for a ``size``-byte buffer."""
        mapped = self.rounded(size)
        ptr = self.driver.vmm_import_fd(self.device, fd, mapped)
        self.sizes[ptr] = mapped
        return ptr

    def free(self, ptr: int, stream: Stream | None = None) -> None:
        """Unmap and release once the context's work is done (``cuMemUnmap`` does not wait for work that uses the
        range, as ``cuMemFree`` does); the memory goes when no importer maps it and no fd of it is left."""
        self.driver.ctx_synchronize()
        self.driver.vmm_free(ptr)
        del self.sizes[ptr]
        self.unexported.discard(ptr)
        charge = self.charges.pop(ptr, None)
        if charge is not None:
            charge.release()

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]:
        return {"mechanism": "vmm", "ipc_handle": b"", "allocation_size": self.sizes[ptr]}

    def export_fd(self, ptr: int, owner: SessionRef) -> int:
        """A new fd of the buffer's allocation (``cuMemExportToShareableHandle``), the caller's: made for each
        importer and for parking, so the daemon holds none per buffer. Where the backend keeps fds of an exported
        allocation (the sim's memfd), its first export counts them against ``owner``'s share of the fd budget
        until the buffer is freed: :class:`LimitExceeded` when they would pass it."""
        if ptr not in self.sizes:
            raise NotShareable(f"this buffer on device {self.device} is not VMM memory")
        held = self.driver.vmm_export_fds
        if not held or ptr not in self.unexported:
            return self.driver.vmm_export_fd(ptr)
        charge = self.budget.charge(held, f"the {self.driver.name} backend's fds of an exported VMM allocation",
                                    owner.fd_peer or owner.token, owner.token)
        try:
            fd = self.driver.vmm_export_fd(ptr)
        except BaseException:
            charge.release()
            raise
        self.unexported.discard(ptr)
        self.charges[ptr] = charge
        return fd

    def scrub(self, ptr: int, size: int) -> None:
        """The whole allocation, padding included: an importer maps all of it."""
        self.driver.memset_d8(ptr, 0, self.sizes[ptr])
