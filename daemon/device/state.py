"""One device's contexts, allocations, streams and shares, per session: the state a device worker owns.

Thread ownership: a :class:`DeviceState` and every part of it belong to exactly
one device worker thread, which is the only caller of their methods and of the
driver for that device (the :class:`~cuctxd.daemon.registry.shares.ShareRegistry`
it updates is the one lock-protected exception). Its parts, each given what it
uses when built:

* :class:`~cuctxd.daemon.device.current.CurrentContext` — the context current on the worker;
* :class:`~cuctxd.daemon.device.pools.Pools` — each context's stream-ordered pool, IPC-capable where it can be;
* :class:`~cuctxd.daemon.device.streams.Streams` — streams, events, markers, read staging;
* :class:`~cuctxd.daemon.device.contexts.Contexts` — stacks, the primary's references, orphans;
* :class:`~cuctxd.daemon.device.sharing.Sharing` — exported buffers and holds;
* :class:`~cuctxd.daemon.device.digest_checks.DigestChecks` — shares' digests checked against their bytes;
* :class:`~cuctxd.daemon.device.memory.Memory` — allocations, quota and reserve;
* :class:`~cuctxd.daemon.device.host.HostBuffers` — shared page-locked host buffers;
* :class:`~cuctxd.daemon.device.shm_lanes.ShmLanes` — the sessions' shm lanes (device ops through shared memory);
* :class:`~cuctxd.daemon.device.parking.DeviceParking` — persistent shares parked with the service manager.

Each session gets a :class:`~cuctxd.daemon.device.entries.SessionOnDevice`
(records in :mod:`cuctxd.daemon.device.entries`). This class ties the parts
together where one event touches several: a session ending, a context destroyed.

A session's close takes time linear in what it held, and runs in chunks of
:data:`CLOSE_CHUNK` objects: the first at once, the rest between the worker's
other requests (:meth:`DeviceState.close_more`), so another session's op waits
for at most about one chunk.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.contexts import Contexts
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.digest_checks import DigestChecks
from cuctxd.daemon.device.entries import DeviceLimits, SessionContext, SessionOnDevice, Share
from cuctxd.daemon.device.host import HostBuffers
from cuctxd.daemon.device.memory import Memory
from cuctxd.daemon.device.parking import DeviceParking
from cuctxd.daemon.device.pools import Pools
from cuctxd.daemon.device.sharing import Sharing
from cuctxd.daemon.device.shm_lanes import ShmLanes
from cuctxd.daemon.device.streams import Streams
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.records import DeviceInfo

#: Objects (holds, streams, events, buffers, contexts) a session's close frees per turn of the worker.
CLOSE_CHUNK = 256
#: What a close's next step is once it has none left.
_DONE = object()


class DeviceState:
    """Everything device ``device`` holds for every session (module docstring); worker thread only."""

    def __init__(self, driver: Driver, device: int, info: DeviceInfo, limits: DeviceLimits,
                 registry: ShareRegistry, tickets: TicketBook) -> None:
        """``tickets``: where the fds this device hands to clients wait for the fd channel; its fd budget
        also counts those the lanes and host buffers here hold."""
        self.driver = driver
        self.device = device
        self.info = info
        self.limits = limits
        self.registry = registry
        self.tickets = tickets
        self.sessions: dict[str, SessionOnDevice] = {}
        self.current = CurrentContext(driver)
        #: Make a context current on the worker (the bound method itself: handlers call it per request).
        self.activate = self.current.activate
        self.pools = Pools(driver, device, self.current, tickets.budget)
        self.streams = Streams(driver, device, self.current, self.sessions, self.pools)
        self.contexts = Contexts(driver, device, self.current, self.streams, limits)
        self.sharing = Sharing(driver, info, self.current, self.contexts, registry, limits, self.sessions)
        self.digest_checks = DigestChecks(driver, device, self.current, registry, self.sharing.shares,
                                          self.sharing.settle)
        self.memory = Memory(driver, device, limits, self.current, self.pools, self.sharing)
        self.host = HostBuffers(driver, device, limits, self.current, self.streams, tickets.budget)
        self.shm_lanes = ShmLanes(limits.max_shm_lanes, tickets.budget)
        self.parking = DeviceParking(driver, info, self.current, self.contexts, self.pools, self.sharing, registry,
                                     self.memory.own_pool_memory, self.memory.legacy_memory,
                                     self.memory.vmm_memory)
        self.sharing.parking = self.parking
        #: The daemon drains (set by a task at its start): a ``wait_version`` that only a new version would
        #: answer is answered ``SHUTTING_DOWN`` now instead of holding the drain up.
        self.draining = False
        #: The sticky CUDA error that made this device unusable, if one struck.
        self.failure: CudaError | None = None
        self.worker_thread: threading.Thread | None = None
        #: Closes of sessions already gone from :attr:`sessions` with objects left to free, oldest first.
        self.closing: deque[Iterator[None]] = deque()

    def find_version_digests(self, share: Share) -> None:
        """The versions ``share`` holds that carry no digest (copied device to device, hashed by no host) get the
        daemon's, found in the background (:meth:`DigestChecks.compute`): when published, and when re-adopted
        after a restart (parked records keep the manifest it was published with)."""
        for name, _, naming, _ in self.registry.versions_of(share):
            if naming.tensors and naming.digest is None:
                self.digest_checks.compute(share, name, naming, share.owner)

    def session(self, ref: SessionRef) -> SessionOnDevice:
        """The session's state here, made empty on its first request to this device."""
        state = self.sessions.get(ref.token)
        if state is None:
            state = self.sessions[ref.token] = SessionOnDevice(ref, self.device)
        return state

    def close_session(self, ref: SessionRef) -> None:
        """Drop the session's holds, free its private buffers, destroy its contexts.

        Its published buffers stay alive for the sessions that open them. The session
        leaves :attr:`sessions` at once; the first :data:`CLOSE_CHUNK` objects go now, the
        rest wait in :attr:`closing` for :meth:`close_more`.
        """
        self.tickets.drop_session(ref.token)
        self.shm_lanes.close(ref.token)
        state = self.sessions.pop(ref.token, None)
        if state is None:
            return
        steps = self._close_steps(state)
        if next(itertools.islice(steps, CLOSE_CHUNK, None), _DONE) is not _DONE:
            self.closing.append(steps)

    def close_more(self) -> None:
        """Free the next :data:`CLOSE_CHUNK` objects of the oldest close in progress (the worker calls it
        between requests while :attr:`closing` is not empty). A step that raised ended its close: what
        it had left stays unfreed until the daemon exits (the caller logs the error)."""
        if self.closing and next(itertools.islice(self.closing[0], CLOSE_CHUNK, None), _DONE) is _DONE:
            self.closing.popleft()

    def _close_steps(self, state: SessionOnDevice) -> Iterator[None]:
        """Free what ``state`` holds, one object per step: linear in what it held."""
        state.stack.clear()
        for share_id in list(state.holds):
            self.sharing.drop_hold(state, share_id, everything=True)
            yield
        for entry in list(state.host_buffers.values()):
            self.host.free(state, entry, wait=True)
            yield
        for handle in list(state.streams):
            self.streams.destroy_stream(state, handle)
            yield
        for handle in list(state.events):
            self.streams.destroy_event(state, handle)
            yield
        for buffer in list(state.buffers.values()):
            self.memory.free(state, buffer, unpublish=False)
            yield
        self.pools.trim()
        for context in list(state.contexts.values()):
            if not context.is_primary:
                self.contexts.detach(state, context)
                yield
        if state.primary is not None:
            self.contexts.release_primary(state.primary)
            state.primary = None

    def destroy_context(self, state: SessionOnDevice, handle: int) -> None:
        """``cuCtxDestroy``: free the context's buffers (unpublishing them), streams and events, then it."""
        context = state.contexts[handle]
        if context.is_primary:
            raise CudaError.of(
                CUresult.CUDA_ERROR_INVALID_CONTEXT,
                "the primary context cannot be destroyed; it is released when the session ends",
            )
        for buffer_handle in list(context.buffers):
            self.memory.free(state, state.buffers[buffer_handle], unpublish=True)
        self._end_created(state, context)

    def _end_created(self, state: SessionOnDevice, context: SessionContext) -> None:
        """Take a created context from the session with what it holds; it ends unless shares live in it."""
        for handle in list(context.buffers):
            self.memory.free(state, state.buffers[handle], unpublish=False)
        self.streams.drop(state, context)
        self.contexts.detach(state, context)

    def live_contexts(self) -> list[SessionContext]:
        """Every distinct context alive on this device (the primary once)."""
        seen: dict[int, SessionContext] = {}
        for state in self.sessions.values():
            for context in state.contexts.values():
                seen.setdefault(context.context_id, context)
        for context in self.contexts.orphans.values():
            seen.setdefault(context.context_id, context)
        for share in self.sharing.shares.values():
            seen.setdefault(share.context.context_id, share.context)
        return list(seen.values())
