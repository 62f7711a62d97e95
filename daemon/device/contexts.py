"""Contexts of one device: each session's stack, the shared primary's references, orphans.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. Each session gets its own
context stack (empty at first, as for a new CUDA host thread); the primary
context is retained once per session that binds it and once per share made in
it, and released as each goes; the daemon keeps the last reference for
``primary_keep`` seconds (its memory meanwhile held), so that the next session
finds the context made (making one took 120-180 ms on the H200). A created
context whose session is gone but whose shares live on is an *orphan*,
destroyed with its last share.
"""

from __future__ import annotations

import time

from cuctxd.daemon.backends.base import Ctx, Driver
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import DeviceLimits, SessionContext, SessionOnDevice, check_limit, new_handle
from cuctxd.daemon.device.streams import Streams
from cuctxd.protos.records import ContextRecord


class Contexts:
    """Binding, creating, naming and ending the device's contexts."""

    def __init__(self, driver: Driver, device: int, current: CurrentContext, streams: Streams,
                 limits: DeviceLimits) -> None:
        self.driver = driver
        self.device = device
        self.current = current
        self.streams = streams
        self.object_limit = limits.max_objects_per_session
        self.context_limit = limits.max_contexts_per_session
        self.primary_keep = limits.primary_keep
        #: References this daemon holds on the primary context (sessions bound + shares made in it).
        self.primary_refs = 0
        #: The primary context while the daemon keeps it, and ``time.monotonic()`` when its last user let go.
        self.kept: SessionContext | None = None
        self.kept_since = 0.0
        #: Created contexts whose session is gone but whose shares are still alive, by context id.
        self.orphans: dict[int, SessionContext] = {}

    @staticmethod
    def top(state: SessionOnDevice) -> SessionContext | None:
        """The session's current context (top of its stack), if any."""
        return state.stack[-1] if state.stack else None

    def current_or_primary(self, state: SessionOnDevice) -> SessionContext:
        """The session's current context, binding the primary lazily as the CUDA runtime does."""
        if state.stack:
            return state.stack[-1]
        primary = self.bind_primary(state)
        state.stack.append(primary)
        return primary

    def for_new(self, state: SessionOnDevice, what: str) -> SessionContext:
        """The context a new buffer, stream or event (``what``) goes in: the session's current one
        (or the primary), once :meth:`SessionOnDevice.check_room` allowed one more object."""
        state.check_room(self.object_limit, what)
        return self.current_or_primary(state)

    def bind_primary(self, state: SessionOnDevice) -> SessionContext:
        """Retain the primary context for this session (once) and name it."""
        if state.primary is None:
            ctx = self.retain_primary()
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
        """``cuCtxCreate``: a new context, pushed on the session's stack (within ``max_contexts_per_session``:
        each costs the device real memory, ~110 ms to make on CUDA, and time to end)."""
        check_limit("max_contexts_per_session", self.context_limit, state.created_contexts(),
                    "created contexts", self.device)
        state.check_room(self.object_limit, "context")
        self.current.clear()
        ctx = self.driver.ctx_create(flags, self.device)
        self.current.adopt(ctx)
        context = self._describe(ctx, is_primary=False)
        state.contexts[context.handle] = context
        state.stack.append(context)
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
        self.current.make_current(ctx)
        return SessionContext(
            handle=new_handle(),
            ctx=ctx,
            is_primary=is_primary,
            flags=self.driver.ctx_get_flags(),
            api_version=self.driver.ctx_get_api_version(ctx),
            context_id=self.driver.ctx_get_id(ctx),
        )

    def detach(self, state: SessionOnDevice, context: SessionContext) -> None:
        """Take a created context, emptied of buffers, streams and events, from the session;
        destroy it unless shares still live in it (then it waits as an orphan).

        O(stack depth): a session being closed empties its stack first, so ending each of its
        contexts stays O(1) (closing N contexts must not take N * depth).
        """
        state.contexts.pop(context.handle, None)
        if state.stack:
            state.stack[:] = [c for c in state.stack if c is not context]
        if context.shares:
            self.orphans[context.context_id] = context
            return
        self.end(context)

    def end(self, context: SessionContext) -> None:
        """Destroy a created context once nothing lives in it any more."""
        self.streams.forget_context(context)
        self.current.forget(context.ctx)
        self.driver.ctx_destroy(context.ctx)

    def retain_primary(self) -> Ctx:
        """One more reference on the primary context (a session binding it, or a share made in it); the first
        takes over the daemon's kept reference, if any."""
        if self.kept is not None:
            ctx = self.kept.ctx
            self.streams.revive(self.kept.context_id)
            self.kept = None
        else:
            ctx = self.driver.primary_ctx_retain(self.device)
        self.primary_refs += 1
        return ctx

    def retain_primary_for_share(self) -> SessionContext:
        """One more reference on the primary, described for a share of no session (an adopted one), current."""
        return self._describe(self.retain_primary(), is_primary=True)

    def release_primary(self, primary: SessionContext) -> None:
        """Drop one reference; with the last, the primary's markers, pool and staging go first, and the
        daemon keeps the context for ``primary_keep`` seconds instead of releasing it."""
        if self.primary_refs == 1:
            self.streams.forget_context(primary)
            self.current.forget(primary.ctx)
            if self.primary_keep > 0:
                self.kept, self.kept_since = primary, time.monotonic()
                self.primary_refs = 0
                return
        self.driver.primary_ctx_release(self.device)
        self.primary_refs -= 1

    def release_kept(self, now: float | None = None) -> None:
        """Release the kept primary context once ``primary_keep`` seconds have passed since its last user
        let go (at once without ``now``: the worker is stopping)."""
        if self.kept is not None and (now is None or now - self.kept_since >= self.primary_keep):
            self.kept = None
            self.driver.primary_ctx_release(self.device)

    def kept_for(self, now: float) -> float | None:
        """Seconds until the kept primary context is released; None when none is kept."""
        return None if self.kept is None else max(0.0, self.kept_since + self.primary_keep - now)
