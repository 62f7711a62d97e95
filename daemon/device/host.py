"""Shared page-locked host buffers of one device's sessions (``host_alloc``).

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`. A host buffer is a memfd the
daemon maps and registers (``cuMemHostRegister``, portable), and whose fd the
client maps too (through the fd channel), sealed against resizing
(:mod:`cuctxd.protos.memfd`) so that the client cannot cut off pages the daemon or
the driver touches: copies between it and device memory are
DMA with nothing but a small request on the socket. Its memfd is backed with 2 MiB pages where the kernel
allows (:mod:`cuctxd.daemon.device.huge_pages`), for the client's ``O_DIRECT`` reads into it. A copy queued on a stream
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device import huge_pages
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
from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.protos.errors import LimitExceeded, SessionClosed
from cuctxd.protos.memfd import sealed_memfd


@dataclass
class MakingHost:
    """A new host buffer of ``state``'s session whose memfd ``fd`` the helper thread is backing with 2 MiB
    pages (``collapsing``: the bytes it got); its bytes and ``charge`` already count."""

    state: SessionOnDevice
    context: SessionContext
    size: int
    keeps: bool
    charge: FdCharge
    fd: int
    collapsing: Future[int]


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
        #: The helper thread that backs new memfds with 2 MiB pages, made with the first.
        self._collapser: ThreadPoolExecutor | None = None

    def alloc(self, state: SessionOnDevice, context: SessionContext, size: int,
              reuse: bool = False) -> tuple[HostBuffer, int] | MakingHost:
        """A kept host buffer (``reuse``: of the same size and uid, its bytes as the last user left them) and
        a new fd of it for the client (the caller owns the fd); else a new one being made: its bytes count
        from now, its memfd goes to 2 MiB pages on the helper thread, and :meth:`finish` registers it once
        ``collapsing`` is done (a busy host spent up to 0.3 s a 128 MiB buffer on that, which this worker's
        other sessions would have waited for)."""
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
        with contextlib.ExitStack() as undo:  # what is made so far, undone when a later step raises
            if kept is not None:
                undo.callback(self.kept.drop, kept)
            charge = self.budget.charge(2 if keeps else 1, "a host buffer", state.ref.fd_peer or state.ref.token,
                                        state.ref.token)
            undo.callback(charge.release)
            if kept is not None:
                fd = os.dup(kept.memfd)
                undo.pop_all()
                entry = HostBuffer(new_handle(), size, kept.memory, kept.view, context, charge=charge,
                                   memfd=kept.memfd, huge_page_bytes=kept.huge_page_bytes)
                self._count(state, size)
                state.host_buffers[entry.handle] = entry
                return entry, fd
            fd = sealed_memfd(f"cuctxd-host-{self.device}", size)
            undo.callback(os.close, fd)
            collapsing = self._helper().submit(huge_pages.collapse, fd, size)
            undo.pop_all()
        self._count(state, size)
        state.host_making += 1
        return MakingHost(state, context, size, keeps, charge, fd, collapsing)

    def finish(self, making: MakingHost, live: bool) -> tuple[HostBuffer, int]:
        """Map and register a buffer :meth:`alloc` began, once its ``collapsing`` is done: the buffer and the
        client's fd. ``live``: its session is still open here; when not, or when this raises, nothing of it
        stays (SessionClosed then)."""
        making.state.host_making -= 1  # a host buffer from here on, or nothing
        with contextlib.ExitStack() as undo:
            undo.callback(self._count, making.state, -making.size)
            undo.callback(making.charge.release)
            undo.callback(os.close, making.fd)
            huge = making.collapsing.result()
            if not live:
                raise SessionClosed(f"the session closed while its host buffer of {making.size} bytes was made")
            own = os.dup(making.fd) if making.keeps else None
            if own is not None:
                undo.callback(os.close, own)
            memory = mmap.mmap(making.fd, making.size)
            undo.callback(memory.close)
            view = memoryview(memory)
            undo.callback(view.release)
            self.current.activate(making.context)
            self.driver.host_register(view)
            undo.pop_all()
        entry = HostBuffer(new_handle(), making.size, memory, view, making.context, charge=making.charge, memfd=own,
                           huge_page_bytes=huge)
        making.state.host_buffers[entry.handle] = entry
        return entry, making.fd

    def close(self) -> None:
        """Once the worker stops: the helper thread ends (nothing is being made by then)."""
        if self._collapser is not None:
            self._collapser.shutdown()

    def _helper(self) -> ThreadPoolExecutor:
        if self._collapser is None:
            self._collapser = ThreadPoolExecutor(1, thread_name_prefix=f"cuctxd-host-pages-{self.device}")
        return self._collapser

    def _count(self, state: SessionOnDevice, size: int) -> None:
        state.host_bytes += size
        self.total_bytes += size

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
        self._count(state, -entry.size)
