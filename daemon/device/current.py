"""Which context is current on a device's worker thread, so the driver is asked to switch only when needed.

Owned by the device's worker thread: the driver's per-thread context stack is
that thread's, kept at depth <= 1 and set to whichever context the next call needs.
"""

from __future__ import annotations

from cuctxd.daemon.backends.base import Ctx, Driver
from cuctxd.daemon.device.entries import SessionContext


class CurrentContext:
    """The worker thread's current driver context (None: none set)."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._ctx: Ctx | None = None

    def activate(self, context: SessionContext) -> None:
        """Make ``context`` current on this worker thread (no-op if it already is)."""
        self.make_current(context.ctx)

    def make_current(self, ctx: Ctx) -> None:
        """As :meth:`activate`, for a driver context no session names yet."""
        if self._ctx is None or self._ctx != ctx:
            self._driver.ctx_set_current(ctx)
            self._ctx = ctx

    def adopt(self, ctx: Ctx) -> None:
        """The driver made ``ctx`` current itself (``cuCtxCreate`` does)."""
        self._ctx = ctx

    def clear(self) -> None:
        """Leave no context current (before ``cuCtxCreate``, which pushes its new context)."""
        if self._ctx is not None:
            self._driver.ctx_set_current(None)
            self._ctx = None

    def forget(self, ctx: Ctx) -> None:
        """``ctx`` is about to go: leave no context current if it is the current one."""
        if self._ctx is not None and self._ctx == ctx:
            self._driver.ctx_set_current(None)
            self._ctx = None
