"""Shared page-locked host buffers of one device's sessions (``host_alloc``).

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. A host buffer is a memfd the
daemon maps and registers (``cuMemHostRegister``, portable), and whose fd the
client maps too (through the fd channel), sealed against resizing
(:mod:`cuctxd.protos.memfd`) so that the client cannot cut off pages the daemon or
the driver touches: copies between it and device memory are
DMA with nothing but a small request on the socket. A copy queued on a stream
leaves a marker on the buffer, and freeing it waits (without blocking the worker)
until those markers pass, so the driver never reads memory that is gone.

Page-locking is the cost of a host buffer (about 0.5 ms a MiB on the H100 host: 40 ms for ``cuctx load``'s
72 MiB ring, more than a fifth of a warm 2.8 GB load), so a freed buffer of at least :data:`KEEP_FROM` bytes is
kept registered (:mod:`cuctxd.daemon.device.host_keep`) for ``primary_keep`` seconds, within ``kept_host_memory``
bytes, and handed again to a ``host_alloc`` of the same size by a session of the same uid that asked for
reused memory (``reuse``: its bytes are what the last user left, as with a caching pinned allocator).
"""

from __future__ import annotations

import contextlib
import mmap
import os

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import (
    DeviceLimits,
    HostBuffer,
    Marker,
    SessionContext,
    SessionOnDevice,
    new_handle,
)
from cuctxd.daemon.device.host_keep import KeptHostBuffers, keepable, unregister_and_unmap
from cuctxd.daemon.device.streams import Streams
from cuctxd.daemon.registry.fd_budget import FdBudget
from cuctxd.protos.errors import LimitExceeded
from cuctxd.protos.memfd import sealed_memfd


class HostBuffers:
    """Making, using and freeing the sessions' host buffers on this device."""

    def __init__(self, driver: Driver, device: int, limits: DeviceLimits, current: CurrentContext,
                 streams: Streams, budget: FdBudget | None = None) -> None:
        """``budget``: where each buffer's mapping counts (Python's ``mmap`` keeps a descriptor of its own)."""
        self.driver = driver
        self.budget = budget if budget is not None else FdBudget()
        self.device = device
        self.limits = limits
        self.current = current
        self.streams = streams
        #: Bytes of every session's host buffers here (with the kept ones, what ``max_host_memory`` bounds).
        self.total_bytes = 0
        self.kept = KeptHostBuffers(driver, limits, current, self.budget)

    def alloc(self, state: SessionOnDevice, context: SessionContext, size: int,
              reuse: bool = False) -> tuple[HostBuffer, int]:
        """A host buffer and a new fd of it for the client (the caller owns the fd); ``reuse``: a kept one
        of the same size and uid where there is one (its bytes as the last user left them)."""
        per_session = self.limits.host_memory_per_session
        if per_session and state.host_bytes + size > per_session:
            raise LimitExceeded(f"host_memory_per_session: the session has {state.host_bytes} bytes of host "
                                f"buffers of {per_session} on device {self.device}, asked for {size} more")
        state.check_room(self.limits.max_objects_per_session, "host buffer")
        kept = self.kept.take(state.ref.uid, size, context) if reuse else None
        device_limit = self.limits.max_host_memory
        if kept is None and device_limit:
            self.kept.make_room(self.total_bytes + self.kept.total_bytes + size - device_limit)
            if self.total_bytes + size > device_limit:
                raise LimitExceeded(f"max_host_memory: host buffers on device {self.device} already hold "
                                    f"{self.total_bytes} of {device_limit} bytes, asked for {size} more")
        keeps = keepable(self.limits, state.ref.uid, size)  # so was a kept one: same uid and size
        memfd: int | None
        with contextlib.ExitStack() as undo:  # what is made so far, undone when a later step raises
            if kept is not None:
                undo.callback(self.kept.drop, kept)
            charge = self.budget.charge(2 if keeps else 1, "a host buffer", state.ref.fd_peer or state.ref.token,
                                        state.ref.token)
            undo.callback(charge.release)
            if kept is not None:
                memory, view, memfd, fd = kept.memory, kept.view, kept.memfd, os.dup(kept.memfd)
            else:
                memory, view, memfd, fd = self._register(context, size, keeps)
            undo.pop_all()
        entry = HostBuffer(new_handle(), size, memory, view, context, charge=charge, memfd=memfd)
        state.host_buffers[entry.handle] = entry
        state.host_bytes += size
        self.total_bytes += size
        return entry, fd

    def _register(self, context: SessionContext, size: int,
                  keeps: bool) -> tuple[mmap.mmap, memoryview, int | None, int]:
        """A new memfd of ``size`` bytes mapped and registered in ``context``: the mapping, the daemon's own
        memfd (where it ``keeps`` one) and the client's; nothing stays open or registered when this raises."""
        with contextlib.ExitStack() as undo:
            fd = sealed_memfd(f"cuctxd-host-{self.device}", size)
            undo.callback(os.close, fd)
            own = os.dup(fd) if keeps else None
            if own is not None:
                undo.callback(os.close, own)
            memory = mmap.mmap(fd, size)
            undo.callback(memory.close)
            view = memoryview(memory)
            undo.callback(view.release)
            self.current.activate(context)
            self.driver.host_register(view)
            undo.pop_all()
        return memory, view, own, fd

    def mark_busy(self, entry: HostBuffer, marker: Marker) -> None:
        """A stream-ordered copy now uses ``entry`` until ``marker`` passes."""
        if entry.busy and self.streams.markers_done(entry.busy):
            self.streams.recycle_markers(entry.busy)
            entry.busy = []
        entry.busy.append(marker)

    def idle(self, entry: HostBuffer) -> bool:
        """True once no queued copy uses ``entry`` (a non-blocking query)."""
        return not entry.busy or self.streams.markers_done(entry.busy)

    def free(self, state: SessionOnDevice, entry: HostBuffer, *, wait: bool = False) -> None:
        """Unregister and unmap; ``wait``: first block until queued copies using it are done (a session's
        close, whose streams are gone); otherwise the caller checked :meth:`idle`. Nothing if it is
        already freed (a ``host_free`` that waited while the session closed)."""
        if state.host_buffers.get(entry.handle) is not entry:
            return
        if wait:
            for context, event in entry.busy:
                if context.context_id not in self.streams.ended_contexts:
                    self.current.activate(context)
                    self.driver.event_synchronize(event)
        self.streams.recycle_markers(entry.busy)
        entry.busy = []
        if entry.charge is not None:
            entry.charge.release()
        if entry.context.context_id in self.streams.ended_contexts:
            unregister_and_unmap(self.driver, self.current, None, entry.view, entry.memory, entry.memfd)
        elif not self.kept.keep(entry, state.ref.uid):
            unregister_and_unmap(self.driver, self.current, entry.context, entry.view, entry.memory, entry.memfd)
        del state.host_buffers[entry.handle]
        state.host_bytes -= entry.size
        self.total_bytes -= entry.size
