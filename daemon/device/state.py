"""One device's contexts, allocations and shares, per session: the state a device worker owns.

Thread ownership: a :class:`DeviceState` belongs to exactly one device worker
thread, which is the only caller of its methods and of the driver for that
device (the :class:`~cuctxd.daemon.registry.shares.ShareRegistry` it updates is the one
lock-protected exception). Each session gets a :class:`SessionOnDevice` holding
its own context stack (empty at first, as for a new CUDA host thread), the
contexts it may name, the buffers it allocated and the shares it holds open.
The driver's own per-thread stack on the worker is kept at depth <= 1 and set
to whichever context the next call needs.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from cuctxd.daemon.backends.base import Ctx, Driver, Event, Pool
from cuctxd.daemon.device.sharing import SharingMixin
from cuctxd.daemon.device.streams import EventEntry, StreamEntry, StreamsMixin
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import Share, ShareRegistry
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError, LimitExceeded, OutOfRange, UnknownHandle
from cuctxd.protos.limits import MAX_HANDLE, MAX_ISSUED_HANDLE
from cuctxd.protos.records import BufferRecord, ContextRecord, DeviceInfo


def new_handle() -> int:
    """An unguessable, session-scoped handle in [1, 2**53): exact in every msgpack decoder."""
    return secrets.randbelow(MAX_ISSUED_HANDLE) + 1


@dataclass(frozen=True)
class DeviceLimits:
    """Per-device limits from the daemon's configuration (0 means none)."""

    max_payload: int
    session_quota: int = 0
    device_reserve: int = 0
    #: Most contexts created + buffers + streams + events + shares held one session may have here.
    max_objects_per_session: int = 0


@dataclass(eq=False)
class SessionContext:
    """A context as one session names it; several sessions share the primary's ``ctx``."""

    handle: int
    ctx: Ctx
    is_primary: bool
    flags: int
    api_version: int
    context_id: int
    buffers: set[int] = field(default_factory=set)
    shares: set[str] = field(default_factory=set)


@dataclass(eq=False)
class Buffer:
    """A device allocation of one session, made in ``context``."""

    handle: int
    ptr: int
    size: int
    context: SessionContext
    shareable: bool
    share: Share | None = None


@dataclass
class SessionOnDevice:
    """A session's view of one device: its context stack, contexts, buffers and holds."""

    ref: SessionRef
    stack: list[SessionContext] = field(default_factory=list)
    contexts: dict[int, SessionContext] = field(default_factory=dict)
    buffers: dict[int, Buffer] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    streams: dict[int, StreamEntry] = field(default_factory=dict)
    events: dict[int, EventEntry] = field(default_factory=dict)
    primary: SessionContext | None = None
    bytes_allocated: int = 0

    def object_count(self) -> int:
        """What ``max_objects_per_session`` counts: created contexts (not the shared primary),
        buffers, streams, events and distinct shares held open."""
        created = len(self.contexts) - (1 if self.primary is not None else 0)
        return created + len(self.buffers) + len(self.streams) + len(self.events) + len(self.holds)


class DeviceState(SharingMixin, StreamsMixin):
    """Contexts, memory, streams and shares of one device for every session (module docstring)."""

    def __init__(self, driver: Driver, device: int, info: DeviceInfo, limits: DeviceLimits,
                 registry: ShareRegistry) -> None:
        self.driver = driver
        self.device = device
        self.info = info
        self.limits = limits
        self.registry = registry
        self.sessions: dict[str, SessionOnDevice] = {}
        self.shares: dict[str, Share] = {}
        #: Created contexts whose session is gone but whose shares are still alive.
        self.orphans: dict[int, SessionContext] = {}
        #: Stream-ordered pools and spare marker events, by context id.
        self.pools: dict[int, Pool] = {}
        self.spare_markers: dict[int, list[Event]] = {}
        #: Page-locked buffers for small synchronous reads, by context id (``staged_read``).
        self.read_staging: dict[int, memoryview] = {}
        #: Ids of contexts that have gone (ids are never reused): markers in them count as passed.
        self.ended_contexts: set[int] = set()
        self.primary_refs = 0
        #: The sticky CUDA error that made this device unusable, if one struck.
        self.failure: CudaError | None = None
        self._current: Ctx | None = None
        self.worker_thread: threading.Thread | None = None

    # --- sessions -------------------------------------------------------------------

    def session(self, ref: SessionRef) -> SessionOnDevice:
        state = self.sessions.get(ref.token)
        if state is None:
            state = self.sessions[ref.token] = SessionOnDevice(ref)
        return state

    def close_session(self, ref: SessionRef) -> None:
        """Drop the session's holds, free its private buffers, destroy its contexts.

        Its published buffers stay alive for the sessions that open them.
        """
        state = self.sessions.pop(ref.token, None)
        if state is None:
            return
        for share_id in list(state.holds):
            self._drop_hold(state, share_id, everything=True)
        self.drop_streams(state)
        for buffer in list(state.buffers.values()):
            self._release_buffer(state, buffer, unpublish=False)
        self.trim_pools()
        for context in list(state.contexts.values()):
            if not context.is_primary:
                self._destroy(state, context)
        if state.primary is not None:
            self._release_primary(state.primary)
            state.primary = None

    # --- contexts -------------------------------------------------------------------

    def activate(self, context: SessionContext) -> None:
        """Make ``context`` current on this worker thread (no-op if it already is)."""
        self._make_current(context.ctx)

    def _make_current(self, ctx: Ctx) -> None:
        if self._current is None or self._current != ctx:
            self.driver.ctx_set_current(ctx)
            self._current = ctx

    def _forget_current(self, ctx: Ctx) -> None:
        if self._current is not None and self._current == ctx:
            self.driver.ctx_set_current(None)
            self._current = None

    def current(self, state: SessionOnDevice) -> SessionContext | None:
        return state.stack[-1] if state.stack else None

    def current_or_primary(self, state: SessionOnDevice) -> SessionContext:
        """The session's current context, binding the primary lazily as the CUDA runtime does."""
        if state.stack:
            return state.stack[-1]
        primary = self.bind_primary(state)
        state.stack.append(primary)
        return primary

    def bind_primary(self, state: SessionOnDevice) -> SessionContext:
        """Retain the primary context for this session (once) and name it."""
        if state.primary is None:
            ctx = self.driver.primary_ctx_retain(self.device)
            self.primary_refs += 1
            state.primary = self._describe(ctx, is_primary=True)
            state.contexts[state.primary.handle] = state.primary
        return state.primary

    def set_device(self, state: SessionOnDevice) -> SessionContext:
        """``cudaSetDevice``: the primary replaces the top of the stack (pushed if empty)."""
        primary = self.bind_primary(state)
        if state.stack:
            state.stack[-1] = primary
        else:
            state.stack.append(primary)
        return primary

    def check_object_limit(self, state: SessionOnDevice, what: str) -> None:
        """Raise :class:`LimitExceeded` if ``state`` may not have one more object (``what``)."""
        limit = self.limits.max_objects_per_session
        if limit and state.object_count() >= limit:
            raise LimitExceeded(
                f"max_objects_per_session: the session already holds {state.object_count()} of {limit} "
                f"objects (contexts, buffers, streams, events, shares held) on device {self.device}; "
                f"free some before making another {what}"
            )

    def create(self, state: SessionOnDevice, flags: int) -> SessionContext:
        self.check_object_limit(state, "context")
        if self._current is not None:
            self.driver.ctx_set_current(None)
            self._current = None
        ctx = self.driver.ctx_create(flags, self.device)
        self._current = ctx
        context = self._describe(ctx, is_primary=False)
        state.contexts[context.handle] = context
        state.stack.append(context)
        return context

    def destroy(self, state: SessionOnDevice, handle: int) -> None:
        context = self.context(state, handle)
        if context.is_primary:
            raise CudaError.of(
                CUresult.CUDA_ERROR_INVALID_CONTEXT,
                "the primary context cannot be destroyed; it is released when the session ends",
            )
        for buffer_handle in list(context.buffers):
            self._release_buffer(state, state.buffers[buffer_handle], unpublish=True)
        self._destroy(state, context)

    def context(self, state: SessionOnDevice, handle: int) -> SessionContext:
        context = state.contexts.get(handle)
        if context is None:
            raise UnknownHandle(f"no context {handle:#x} in this session on device {self.device}")
        return context

    def record(self, context: SessionContext) -> ContextRecord:
        return ContextRecord(
            handle=context.handle,
            device=self.device,
            is_primary=context.is_primary,
            api_version=context.api_version,
            flags=context.flags,
            context_id=context.context_id,
        )

    def _describe(self, ctx: Ctx, *, is_primary: bool) -> SessionContext:
        self._make_current(ctx)
        return SessionContext(
            handle=new_handle(),
            ctx=ctx,
            is_primary=is_primary,
            flags=self.driver.ctx_get_flags(),
            api_version=self.driver.ctx_get_api_version(ctx),
            context_id=self.driver.ctx_get_id(ctx),
        )

    def _destroy(self, state: SessionOnDevice, context: SessionContext) -> None:
        """Take a created context from the session; destroy it unless shares still live in it."""
        for handle in list(context.buffers):
            self._release_buffer(state, state.buffers[handle], unpublish=False)
        self.drop_streams(state, context)
        state.contexts.pop(context.handle, None)
        state.stack[:] = [c for c in state.stack if c is not context]
        if context.shares:
            self.orphans[context.context_id] = context
            return
        self.end_context(context)

    def end_context(self, context: SessionContext) -> None:
        """Destroy a created context once nothing lives in it any more."""
        self.forget_context_objects(context)
        self._forget_current(context.ctx)
        self.driver.ctx_destroy(context.ctx)

    def _release_primary(self, primary: SessionContext) -> None:
        if self.primary_refs == 1:
            self.forget_context_objects(primary)
            self._forget_current(primary.ctx)
        self.driver.primary_ctx_release(self.device)
        self.primary_refs -= 1

    def live_contexts(self) -> list[SessionContext]:
        """Every distinct context alive on this device (the primary once)."""
        seen: dict[int, SessionContext] = {}
        for state in self.sessions.values():
            for context in state.contexts.values():
                seen.setdefault(context.context_id, context)
        for context in self.orphans.values():
            seen.setdefault(context.context_id, context)
        for share in self.shares.values():
            seen.setdefault(share.context.context_id, share.context)
        return list(seen.values())

    # --- memory ---------------------------------------------------------------------

    def alloc(self, state: SessionOnDevice, size: int, shareable: bool) -> Buffer:
        """From the context's stream-ordered pool, or ``cuMemAlloc`` when it must be exportable."""
        self.check_object_limit(state, "buffer")
        context = self.current_or_primary(state)
        self.activate(context)
        self._check_quota(state, size)
        try:
            ptr = self._allocate(context, size, shareable)
        except CudaError as exc:
            if exc.code != CUresult.CUDA_ERROR_OUT_OF_MEMORY or not self.pools:
                raise
            self.driver.ctx_synchronize()  # let pending stream-ordered frees land, then give them back
            self.trim_pools()
            self.activate(context)
            ptr = self._allocate(context, size, shareable)
        buffer = Buffer(new_handle(), ptr, size, context, shareable)
        state.buffers[buffer.handle] = buffer
        state.bytes_allocated += size
        context.buffers.add(buffer.handle)
        return buffer

    def _allocate(self, context: SessionContext, size: int, shareable: bool) -> int:
        if shareable:
            return self.driver.mem_alloc(size)
        return self.driver.mem_alloc_from_pool(size, self.pool_of(context), None)

    def _check_quota(self, state: SessionOnDevice, size: int) -> None:
        quota, reserve = self.limits.session_quota, self.limits.device_reserve
        if quota and state.bytes_allocated + size > quota:
            raise CudaError.of(
                CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                f"session quota of {quota} bytes on device {self.device}: "
                f"{state.bytes_allocated} in use, {size} more asked",
            )
        if reserve:
            free, _ = self.driver.mem_get_info()
            if free - size < reserve:
                raise CudaError.of(
                    CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                    f"device reserve of {reserve} bytes on device {self.device}: {free} free, {size} asked",
                )

    def mem_get_info(self, state: SessionOnDevice) -> dict[str, int | str | None]:
        """``cuMemGetInfo`` as this session sees it: free is capped by its quota and the reserve."""
        self.activate(self.current_or_primary(state))
        device_free, total = self.driver.mem_get_info()
        device_free += sum(self.driver.mem_pool_cached(pool) for pool in self.pools.values())
        free, limited_by = max(0, device_free - self.limits.device_reserve), "device"
        quota = self.limits.session_quota
        if quota and quota - state.bytes_allocated < free:
            free, limited_by = max(0, quota - state.bytes_allocated), "quota"
        return {
            "free": free,
            "total": total,
            "device_free": device_free,
            "quota": quota or None,
            "reserve": self.limits.device_reserve,
            "limited_by": limited_by,
        }

    def free(self, state: SessionOnDevice, handle: int) -> None:
        self._release_buffer(state, self.buffer(state, handle), unpublish=True)

    def _release_buffer(self, state: SessionOnDevice, buffer: Buffer, *, unpublish: bool) -> None:
        """The owner lets go of a buffer: free it, or leave it to its share's other holders."""
        if buffer.share is None:
            self.activate(buffer.context)
            if buffer.shareable:
                self.driver.mem_free(buffer.ptr)
            else:
                self.driver.mem_free_async(buffer.ptr, None)
        else:
            share = buffer.share
            share.owner_present = False
            share.orphaned_at = time.monotonic()
            share.opened_since_orphaned = bool(share.holders)
            if unpublish:
                self.registry.drop_names(share)
            self._settle(share)
        del state.buffers[buffer.handle]
        state.bytes_allocated -= buffer.size
        buffer.context.buffers.discard(buffer.handle)

    def buffer(self, state: SessionOnDevice, handle: int) -> Buffer:
        buffer = state.buffers.get(handle)
        if buffer is None:
            raise UnknownHandle(f"no buffer {handle:#x} in this session on device {self.device}")
        return buffer

    def buffer_record(self, buffer: Buffer) -> BufferRecord:
        return BufferRecord(handle=buffer.handle, device=self.device, size=buffer.size,
                            context=buffer.context.handle, shareable=buffer.shareable)

def check_range(size_of_buffer: int, offset: int, size: int | None) -> int:
    """Validate ``[offset, offset+size)`` inside a buffer; return the resolved size."""
    if offset > size_of_buffer:
        raise OutOfRange(f"offset {offset} is past the end of a {size_of_buffer}-byte buffer")
    if size is None:
        size = size_of_buffer - offset
    if size > MAX_HANDLE or offset + size > size_of_buffer:
        raise OutOfRange(f"range [{offset}, {offset + size}) is outside a {size_of_buffer}-byte buffer")
    return size
