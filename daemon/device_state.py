"""One device's contexts and allocations, per session: the state a device worker owns.

Thread ownership: a :class:`DeviceState` belongs to exactly one device worker
thread, which is the only caller of its methods and of the driver for that
device. Each session gets a :class:`SessionOnDevice` holding its own context
stack (empty at first, as for a new CUDA host thread), the contexts it may name
and the buffers it allocated. The driver's own per-thread stack on the worker is
kept at depth <= 1 and simply set to whichever context the next call needs.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from daemon.backends.base import Ctx, Driver
from daemon.sessions import SessionRef
from protos.cuda_results import CUresult
from protos.errors import CudaError, OutOfRange, UnknownHandle
from protos.limits import MAX_HANDLE
from protos.records import BufferRecord, ContextRecord, DeviceInfo


def new_handle() -> int:
    """An unguessable, session-scoped handle (62 random bits, never 0)."""
    return secrets.randbits(62) | 1


@dataclass
class SessionContext:
    """A context as one session names it; several sessions share the primary's ``ctx``."""

    handle: int
    ctx: Ctx
    is_primary: bool
    flags: int
    api_version: int
    context_id: int
    buffers: set[int] = field(default_factory=set)


@dataclass
class Buffer:
    """A device allocation of one session, made in ``context``."""

    handle: int
    ptr: int
    size: int
    context: SessionContext


@dataclass
class SessionOnDevice:
    """A session's view of one device: its context stack, contexts and buffers."""

    ref: SessionRef
    stack: list[SessionContext] = field(default_factory=list)
    contexts: dict[int, SessionContext] = field(default_factory=dict)
    buffers: dict[int, Buffer] = field(default_factory=dict)
    primary: SessionContext | None = None

    def bytes_allocated(self) -> int:
        return sum(b.size for b in self.buffers.values())


class DeviceState:
    """Contexts and memory of one device for every session; see the module docstring."""

    def __init__(self, driver: Driver, device: int, info: DeviceInfo, max_payload: int) -> None:
        self.driver = driver
        self.device = device
        self.info = info
        self.max_payload = max_payload
        self.sessions: dict[str, SessionOnDevice] = {}
        self._current: Ctx | None = None
        self._primary_refs = 0
        self.worker_thread: threading.Thread | None = None

    # --- sessions -------------------------------------------------------------------

    def session(self, ref: SessionRef) -> SessionOnDevice:
        state = self.sessions.get(ref.token)
        if state is None:
            state = self.sessions[ref.token] = SessionOnDevice(ref)
        return state

    def close_session(self, ref: SessionRef) -> None:
        """Destroy the session's contexts and free its allocations on this device."""
        state = self.sessions.pop(ref.token, None)
        if state is None:
            return
        for context in list(state.contexts.values()):
            if not context.is_primary:
                self._destroy(state, context)
        if state.primary is not None:
            self._unbind_primary(state)

    # --- contexts -------------------------------------------------------------------

    def activate(self, context: SessionContext) -> None:
        """Make ``context`` current on this worker thread (no-op if it already is)."""
        self._make_current(context.ctx)

    def _make_current(self, ctx: Ctx) -> None:
        if self._current is None or self._current != ctx:
            self.driver.ctx_set_current(ctx)
            self._current = ctx

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
            self._primary_refs += 1
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

    def create(self, state: SessionOnDevice, flags: int) -> SessionContext:
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
        for handle in context.buffers:
            state.buffers.pop(handle, None)
        if self._current is not None and self._current == context.ctx:
            self.driver.ctx_set_current(None)
            self._current = None
        self.driver.ctx_destroy(context.ctx)
        state.contexts.pop(context.handle, None)
        state.stack[:] = [c for c in state.stack if c is not context]

    def _unbind_primary(self, state: SessionOnDevice) -> None:
        primary = state.primary
        assert primary is not None
        if primary.buffers:
            self.activate(primary)
            for handle in list(primary.buffers):
                self.free(state, handle)
        if self._current is not None and self._current == primary.ctx and self._primary_refs == 1:
            self.driver.ctx_set_current(None)
            self._current = None
        self.driver.primary_ctx_release(self.device)
        self._primary_refs -= 1
        state.primary = None

    def live_contexts(self) -> list[SessionContext]:
        """Every distinct context alive on this device (the primary once)."""
        seen: dict[int, SessionContext] = {}
        for state in self.sessions.values():
            for context in state.contexts.values():
                seen.setdefault(context.context_id, context)
        return list(seen.values())

    # --- memory ---------------------------------------------------------------------

    def alloc(self, state: SessionOnDevice, size: int) -> Buffer:
        context = self.current_or_primary(state)
        self.activate(context)
        ptr = self.driver.mem_alloc(size)
        buffer = Buffer(new_handle(), ptr, size, context)
        state.buffers[buffer.handle] = buffer
        context.buffers.add(buffer.handle)
        return buffer

    def free(self, state: SessionOnDevice, handle: int) -> None:
        buffer = self.buffer(state, handle)
        self.activate(buffer.context)
        self.driver.mem_free(buffer.ptr)
        del state.buffers[handle]
        buffer.context.buffers.discard(handle)

    def buffer(self, state: SessionOnDevice, handle: int) -> Buffer:
        buffer = state.buffers.get(handle)
        if buffer is None:
            raise UnknownHandle(f"no buffer {handle:#x} in this session on device {self.device}")
        return buffer

    def buffer_record(self, buffer: Buffer) -> BufferRecord:
        return BufferRecord(
            handle=buffer.handle, device=self.device, size=buffer.size, context=buffer.context.handle
        )

    # --- status ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This device's part of ``status``; only public ids, never session tokens."""
        flags, active = self.driver.primary_ctx_state(self.device)
        thread = self.worker_thread or threading.current_thread()
        contexts = []
        for context in self.live_contexts():
            owners = sorted(
                s.ref.public_id for s in self.sessions.values()
                if any(c.context_id == context.context_id for c in s.contexts.values())
            )
            contexts.append({
                "context_id": context.context_id,
                "is_primary": context.is_primary,
                "flags": context.flags,
                "sessions": owners,
            })
        return {
            "device": self.device,
            "name": self.info.name,
            "worker": {"name": thread.name, "native_id": thread.native_id, "alive": thread.is_alive()},
            "primary_context": {"active": bool(active), "flags": flags, "sessions": self._primary_refs},
            "contexts": contexts,
            "sessions": [
                {
                    "session": s.ref.public_id,
                    "contexts": len(s.contexts),
                    "stack_depth": len(s.stack),
                    "allocations": len(s.buffers),
                    "bytes": s.bytes_allocated(),
                }
                for s in self.sessions.values()
            ],
        }


def check_range(buffer: Buffer, offset: int, size: int | None) -> int:
    """Validate ``[offset, offset+size)`` inside ``buffer``; return the resolved size."""
    if offset > buffer.size:
        raise OutOfRange(f"offset {offset} is past the end of a {buffer.size}-byte buffer")
    if size is None:
        size = buffer.size - offset
    if size > MAX_HANDLE or offset + size > buffer.size:
        raise OutOfRange(f"range [{offset}, {offset + size}) is outside a {buffer.size}-byte buffer")
    return size
