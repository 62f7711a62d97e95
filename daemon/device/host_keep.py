"""Freed host buffers kept page-locked for the next ``host_alloc`` with ``reuse`` (PROTOCOL.md section 7,
"Kept host buffers").

Page-locking is most of what a host buffer costs (about 0.5 ms a MiB on the H100 host: 30-45 ms for a
72 MiB ring), so :class:`~cuctxd.daemon.device.host.HostBuffers` hands a freed buffer here instead of
unregistering it, and takes one back for a ``reuse`` of the same size by the same uid. They stay registered in
the device's primary context, which the daemon keeps as long (``primary_keep``), and go before it. Part of
the device's :class:`~cuctxd.daemon.device.state.DeviceState`: worker thread only.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import deque
from dataclasses import dataclass

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import DeviceLimits, HostBuffer, SessionContext
from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.protos.errors import LimitExceeded

#: Smallest host buffer kept registered once freed (smaller ones cost little to page-lock again).
KEEP_FROM = 1 << 20
#: Most host buffers kept per device (each holds two fds: the daemon's mapping and the memfd to hand out).
KEEP_MOST = 4
#: Whose share of the fd budget kept buffers count in (no session holds them).
KEPT_PEER = "daemon:kept-host-buffers"


def keepable(limits: DeviceLimits, uid: int | None, size: int) -> bool:
    """Whether a host buffer of ``size`` of a session of ``uid`` may be kept once freed."""
    return uid is not None and limits.primary_keep > 0 and KEEP_FROM <= size <= limits.kept_host_memory


def unregister_and_unmap(driver: Driver, current: CurrentContext, context: SessionContext | None,
                         view: memoryview, memory: mmap.mmap, memfd: int | None) -> None:
    """Unregister a host buffer's mapping in ``context`` (None: the context has ended, and its registrations
    with it), then unmap it and close the daemon's memfd, whatever the driver said."""
    try:
        if context is not None:
            current.activate(context)
            driver.host_unregister(view)
    finally:
        if memfd is not None:
            os.close(memfd)
        view.release()
        memory.close()


@dataclass
class KeptHost:
    """A freed host buffer still registered in the device's primary context: its mapping, its memfd, and
    the uid of the sessions that may have it again."""

    uid: int
    size: int
    memory: mmap.mmap
    view: memoryview
    memfd: int
    context: SessionContext
    since: float
    charge: FdCharge
    huge_page_bytes: int


class KeptHostBuffers:
    """The freed host buffers kept registered, oldest first; worker thread only."""

    def __init__(self, driver: Driver, limits: DeviceLimits, current: CurrentContext, budget: FdBudget) -> None:
        self.driver = driver
        self.limits = limits
        self.current = current
        self.budget = budget
        self.buffers: deque[KeptHost] = deque()

    @property
    def total_bytes(self) -> int:
        return sum(kept.size for kept in self.buffers)

    def keep(self, entry: HostBuffer, uid: int | None) -> bool:
        """Take ``entry`` (freed by its session, no copy using it) instead of unregistering it; False when it
        may not be kept (:func:`keepable`, and made so: it holds its memfd) or no fd is left for it."""
        if uid is None or entry.memfd is None or not keepable(self.limits, uid, entry.size):
            return False
        try:
            charge = self.budget.charge(2, "a kept host buffer", KEPT_PEER)
        except LimitExceeded:
            return False
        while self.buffers and (len(self.buffers) >= KEEP_MOST
                                or self.total_bytes + entry.size > self.limits.kept_host_memory):
            self._release(self.buffers.popleft())
        self.buffers.append(KeptHost(uid, entry.size, entry.memory, entry.view, entry.memfd, entry.context,
                                     time.monotonic(), charge, entry.huge_page_bytes))
        return True

    def take(self, uid: int | None, size: int, context: SessionContext) -> KeptHost | None:
        """The kept buffer of ``size`` bytes of ``uid`` registered in ``context`` (the primary), out of the
        keep; None when there is none."""
        for kept in self.buffers:
            if kept.uid == uid and kept.size == size and kept.context.context_id == context.context_id:
                self.buffers.remove(kept)
                kept.charge.release()
                return kept
        return None

    def drop(self, kept: KeptHost) -> None:
        """Unregister a buffer :meth:`take` gave out and nobody uses."""
        self._release(kept, charged=False)

    def release(self, now: float | None = None) -> None:
        """Unregister the buffers kept ``primary_keep`` seconds, oldest first (all without ``now``: the worker
        is stopping)."""
        while self.buffers and (now is None or now - self.buffers[0].since >= self.limits.primary_keep):
            self._release(self.buffers.popleft())

    def make_room(self, room: int) -> None:
        """Unregister the oldest buffers until ``room`` bytes of them are gone (or none is left; nothing for
        ``room`` of 0 or less)."""
        while self.buffers and room > 0:
            kept = self.buffers.popleft()
            room -= kept.size
            self._release(kept)

    def _release(self, kept: KeptHost, *, charged: bool = True) -> None:
        if charged:
            kept.charge.release()
        unregister_and_unmap(self.driver, self.current, kept.context, kept.view, kept.memory, kept.memfd)
