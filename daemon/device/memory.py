"""Device memory of one device: allocations per session, quotas, the device reserve.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. Buffers come from the private pool of
their context and their session's uid (above ``POOL_BUFFER_MAX``, ``cuMemAlloc``); ``shareable`` ones
from VMM where the device has it, else a pool of their own up to ``POOL_BUFFER_MAX``, else ``cuMemAlloc``
(:mod:`cuctxd.daemon.device.pools`). Quotas and the reserve count what each buffer takes of the device
(its kind's footprint: a 4 KiB ``shareable`` buffer takes a 2 MiB VMM allocation).
"""

from __future__ import annotations

import secrets
from typing import Any

from cuctxd.daemon.backends.base import Driver, Stream
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import (
    Buffer,
    DeviceLimits,
    MemoryKind,
    SessionContext,
    SessionOnDevice,
    new_handle,
)
from cuctxd.daemon.device.pools import LegacyMemory, OwnPoolMemory, Pools, PrivatePoolMemory, VmmMemory
from cuctxd.daemon.device.sharing import Sharing
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.limits import POOL_BUFFER_MAX
from cuctxd.protos.records import BufferRecord


class Memory:
    """Allocating and freeing the sessions' buffers on this device."""

    def __init__(self, driver: Driver, device: int, limits: DeviceLimits, current: CurrentContext,
                 pools: Pools, sharing: Sharing) -> None:
        self.driver = driver
        self.device = device
        self.limits = limits
        self.current = current
        self.pools = pools
        self.sharing = sharing
        self.private_memory = PrivatePoolMemory(driver, pools)
        self.own_pool_memory = OwnPoolMemory(driver, pools)
        self.legacy_memory = LegacyMemory(driver)
        self.vmm_memory = VmmMemory(driver, device, pools.budget)

    def kind_for(self, size: int, shareable: bool) -> MemoryKind:
        """A ``shareable`` buffer: VMM memory where the device has it (one allocation an fd names and keeps
        alive: it can be parked), else a pool of its own up to :data:`POOL_BUFFER_MAX` where pools can export,
        else legacy memory. Any other buffer: the private pool, legacy memory above :data:`POOL_BUFFER_MAX`."""
        if shareable and self.vmm_memory.supported:
            return self.vmm_memory
        if size > POOL_BUFFER_MAX:
            return self.legacy_memory
        if shareable:
            return self.own_pool_memory if self.pools.ipc else self.legacy_memory
        return self.private_memory

    def alloc(self, state: SessionOnDevice, context: SessionContext, size: int, shareable: bool, *,
              handle: int | None = None, stream: Stream | None = None) -> Buffer:
        """A buffer of ``size`` bytes in ``context`` (``Contexts.for_new`` checked the
        object limit and picked it).

        Blocks the worker in one case: when the device is out of memory while
        stream-ordered pools hold some, ``cuCtxSynchronize`` lets pending
        stream-ordered frees land, the pools are trimmed and the allocation is
        tried once more.
        """
        self.current.activate(context)
        kind = self.kind_for(size, shareable)
        footprint = kind.footprint(size)
        self._check_quota(state, footprint)
        try:
            ptr = kind.allocate(context, size, stream, state.ref)
        except CudaError as exc:
            if exc.code != CUresult.CUDA_ERROR_OUT_OF_MEMORY or not self.pools.entries:
                raise
            self.driver.ctx_synchronize()
            self.pools.trim()
            self.current.activate(context)
            ptr = kind.allocate(context, size, stream, state.ref)
        buffer = Buffer(new_handle() if handle is None else handle, ptr, size, context, kind)
        self._add(state, buffer, footprint)
        return buffer

    def alloc_version(self, state: SessionOnDevice, context: SessionContext, size: int, name: str) -> Buffer:
        """A shareable buffer for ``name``'s next version (``alloc`` with ``version_of``): the name's spare on this
        device where it has ``size`` bytes and this session may publish the name (nothing allocated, the same
        buffer id: :mod:`cuctxd.daemon.device.spares`), else a new allocation with a buffer id of its own. A spare
        of another size or device is released (here now, elsewhere by its worker's next sweep)."""
        spares = self.sharing.spares
        if self.kind_for(size, True) is self.vmm_memory:
            footprint = self.vmm_memory.footprint(size)
            state.check_quota(self.limits.session_quota, footprint, "allocate")
            claimed, dropped = self.sharing.registry.claim_spare(name, state.ref, self.device, size)
            found = spares.take(name) if claimed is not None else None
            if dropped:
                spares.release_stale()
            if found is not None:
                buffer = Buffer(new_handle(), found.ptr, size, context, found.kind, buffer_id=found.spare.buffer_id,
                                spare_of=name)
                spares.handed_over(found)
                self._add(state, buffer, footprint)
                return buffer
        buffer = self.alloc(state, context, size, True)
        buffer.buffer_id = secrets.token_hex(16)
        return buffer

    def _add(self, state: SessionOnDevice, buffer: Buffer, footprint: int) -> None:
        state.buffers[buffer.handle] = buffer
        state.bytes_allocated += footprint
        buffer.context.buffers.add(buffer.handle)

    def _check_quota(self, state: SessionOnDevice, size: int) -> None:
        state.check_quota(self.limits.session_quota, size, "allocate")
        reserve = self.limits.device_reserve
        if reserve:
            free, _ = self.driver.mem_get_info()
            if free - size < reserve:
                raise CudaError.of(
                    CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                    f"device reserve of {reserve} bytes on device {self.device}: {free} free, {size} asked",
                )

    def info(self, state: SessionOnDevice) -> dict[str, Any]:
        """``cuMemGetInfo`` as this session sees it (its current context active): free is capped by its
        quota (less what it allocated and holds in shares) and the reserve."""
        device_free, total = self.driver.mem_get_info()
        device_free += self.pools.cached()
        free, limited_by = max(0, device_free - self.limits.device_reserve), "device"
        quota = self.limits.session_quota
        if quota and quota - state.bytes_charged() < free:
            free, limited_by = max(0, quota - state.bytes_charged()), "quota"
        return {
            "free": free,
            "total": total,
            "device_free": device_free,
            "quota": quota or None,
            "reserve": self.limits.device_reserve,
            "limited_by": limited_by,
        }

    def free(self, state: SessionOnDevice, buffer: Buffer, *, unpublish: bool, stream: Stream | None = None) -> None:
        """The owner lets go of a buffer: free it (in order on ``stream``, pool memory), or leave it to its
        share's other holders (its published names go too when ``unpublish``)."""
        if buffer.share is None:
            if stream is None:
                self.current.activate(buffer.context)
            if buffer.spare_of:
                buffer.kind.scrub(buffer.ptr, buffer.size)
            buffer.kind.free(buffer.ptr, stream)
        else:
            self.sharing.owner_left(state, buffer.share, unpublish=unpublish)
        del state.buffers[buffer.handle]
        state.bytes_allocated -= buffer.footprint
        buffer.context.buffers.discard(buffer.handle)

    def record(self, buffer: Buffer) -> BufferRecord:
        return BufferRecord(handle=buffer.handle, device=self.device, size=buffer.size,
                            context=buffer.context.handle, shareable=buffer.kind.exportable)
