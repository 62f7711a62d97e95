"""Plain records of what one device holds: contexts, buffers, streams, events, shares.

The leaf of :mod:`cuctxd.daemon.device`: data and lookups only, no driver calls. Every
record here belongs to one device worker thread, like the
:class:`~cuctxd.daemon.device.state.DeviceState` that holds it; handles are
session-scoped, so a session can only ever name its own records.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from cuctxd.daemon.backends.base import Ctx, Event, Stream
from cuctxd.daemon.device.shm_lanes import DEFAULT_MAX_SHM_LANES
from cuctxd.daemon.registry.daemon_state import PayloadLimit
from cuctxd.daemon.registry.fd_budget import FdCharge
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.sorted_names import SortedNames
from cuctxd.daemon.settings import count, seconds, size
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CuctxError, CudaError, LimitExceeded, OutOfRange, UnknownHandle
from cuctxd.protos.limits import MAX_DEFERRED_ERRORS, MAX_HANDLE, MAX_ISSUED_HANDLE
from cuctxd.protos.records import ShareDescriptor

T = TypeVar("T")


def new_handle() -> int:
    """An unguessable, session-scoped handle in [1, 2**53): exact in every msgpack decoder."""
    return secrets.randbelow(MAX_ISSUED_HANDLE) + 1


#: Object limits that protect a shared machine (PROTOCOL.md, "Limits"); 0 in the configuration means none.
DEFAULT_MAX_OBJECTS_PER_SESSION = 16384
DEFAULT_MAX_CONTEXTS_PER_SESSION = 64
DEFAULT_MAX_SHARES_PER_SESSION = 1024
DEFAULT_MAX_ORPHANED_SHARES = 4096
#: Bytes of host buffers (``host_alloc``, staging rings) one session may have on each device.
DEFAULT_HOST_MEMORY_PER_SESSION = 4 << 30
#: Seconds a device's primary context is kept after its last user let go: making one again took 120-180 ms on
#: the H200 (every new client process's first op paid it when the daemon was otherwise idle).
DEFAULT_PRIMARY_KEEP = 60.0
DEFAULT_KEPT_HOST_MEMORY = 256 << 20


def _quarter_of_memory() -> int:
    """A quarter of the host's physical memory: what host buffers of all sessions may pin per device."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (OSError, ValueError):
        return 16 << 30


DEFAULT_MAX_HOST_MEMORY = _quarter_of_memory()


@dataclass(frozen=True)
class DeviceLimits(PayloadLimit):
    """Per-device limits (0 means none), each a setting of the daemon (:mod:`cuctxd.daemon.settings`); one
    object shared by every device's worker, read only."""

    session_quota: int = size(0, "most memory one session may hold on each device", zero="no quota", limit=True,
                              user=True)
    device_reserve: int = size(0, "memory of each device that allocations must leave free", limit=True, user=True)
    #: Most contexts created + buffers + streams + events + shares held one session may have here.
    max_objects_per_session: int = count(
        DEFAULT_MAX_OBJECTS_PER_SESSION, "most contexts, buffers, streams, events and share holds one session may "
        "have on each device", zero="no limit", security=True, limit=True)
    #: Most contexts one session may have created here (the primary does not count).
    max_contexts_per_session: int = count(DEFAULT_MAX_CONTEXTS_PER_SESSION, "most contexts one session may create "
                                          "on each device", zero="no limit", security=True, limit=True)
    #: Most shares one session may have exported (alive) plus held open here.
    max_shares_per_session: int = count(DEFAULT_MAX_SHARES_PER_SESSION, "most shares one session may have exported "
                                        "plus held open on each device", zero="no limit", security=True, limit=True)
    #: Most published shares whose owner is gone and nobody holds, daemon-wide (oldest freed first).
    max_orphaned_shares: int = count(DEFAULT_MAX_ORPHANED_SHARES, "most published buffers whose owner left and "
                                     "nobody holds, daemon-wide; beyond it the oldest are freed", zero="no limit",
                                     security=True, limit=True)
    #: Most bytes of host buffers one session may have here, and all sessions together.
    host_memory_per_session: int = size(DEFAULT_HOST_MEMORY_PER_SESSION, "bytes of host buffers (host_alloc, "
                                        "staging rings) one session may have on each device", zero="no limit",
                                        security=True, limit=True)
    max_host_memory: int = size(DEFAULT_MAX_HOST_MEMORY, "bytes of host buffers of all sessions on each device, "
                                "pinned memory", shown="a quarter of the host's memory", zero="no limit",
                                security=True, limit=True)
    #: Most shm lanes open to this device at once.
    max_shm_lanes: int = count(DEFAULT_MAX_SHM_LANES, "shm lanes open to each device at once; beyond, sessions use "
                               "the socket", zero="no limit", security=True, limit=True)
    #: Most bytes of published shares whose owner is gone and nobody holds, of one owner uid here
    #: (0: the device's memory; never none).
    max_orphaned_bytes_per_uid: int = size(0, "bytes of published buffers whose owner left and nobody holds, per "
                                           "user and device; publish is refused beyond it",
                                           shown="0: the device's memory", security=True, limit=True)
    #: Seconds the primary context is kept after its last reference went (0: released at once); freed host
    #: buffers are kept as long, within ``kept_host_memory`` bytes (0: none).
    primary_keep: float = seconds(DEFAULT_PRIMARY_KEEP, "keep a device's primary context this long after its last "
                                  "session or share let go, so that the next session need not wait for a new one "
                                  "(its memory stays held meanwhile)", zero="release it at once", limit=True, user=True)
    kept_host_memory: int = size(DEFAULT_KEPT_HOST_MEMORY, "bytes of freed host buffers (of 1 MiB or more, at most "
                                 "4) kept page-locked on each device for primary_keep seconds, for the next "
                                 "host_alloc of the same size and user that accepts reused memory (cuctx load's "
                                 "ring)", zero="none kept", limit=True)


class HandleTable(dict[int, T], Generic[T]):
    """Handle -> record; ``table[handle]`` raises :class:`UnknownHandle` for a handle the session
    does not hold (``get``/``pop``/``in`` behave as for any dict). Indexing stays a C-level dict
    lookup: only a miss reaches Python."""

    def __init__(self, kind: str, device: int, failed: dict[int, CuctxError] | None = None) -> None:
        """``failed``: errors of stream-ordered entries that never made their handle (reported once)."""
        super().__init__()
        self.kind = kind
        self.device = device
        self.failed = failed

    def __missing__(self, handle: int) -> T:
        if self.failed:
            error = self.failed.pop(handle, None)
            if error is not None:
                raise error
        raise UnknownHandle(f"no {self.kind} {handle:#x} in this session on device {self.device}")


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


class MemoryKind(Protocol):
    """How a buffer's memory is freed and exported (:mod:`cuctxd.daemon.device.pools`)."""

    exportable: bool

    def allocate(self, context: SessionContext, size: int, stream: Stream | None, session: SessionRef) -> int:
        """``size`` bytes for ``session`` in ``context`` (current), in order on ``stream`` (None: the legacy one)."""

    def free(self, ptr: int, stream: Stream | None = None) -> None: ...

    def footprint(self, size: int) -> int:
        """What a ``size``-byte buffer of this kind takes of the device: what quotas charge for it."""

    def export(self, context: SessionContext, ptr: int) -> dict[str, Any]: ...

    def scrub(self, ptr: int, size: int) -> None:
        """Zero the memory of a ``size``-byte buffer at ``ptr`` (its context current) before it is freed."""


@dataclass
class Share:
    """One shared buffer (lifetime rule: :mod:`cuctxd.daemon.registry.shares`). Owned by its device's
    worker thread, like the buffer itself; :class:`~cuctxd.daemon.registry.shares.ShareRegistry` indexes it."""

    descriptor: ShareDescriptor
    ptr: int
    context: SessionContext
    owner: SessionRef
    kind: MemoryKind
    owner_present: bool = True
    holders: dict[str, int] = field(default_factory=dict)
    #: Its published names, sorted: ``status`` lists the first ones without sorting them all.
    names: SortedNames = field(default_factory=SortedNames)
    opened_since_orphaned: bool = False
    #: ``time.monotonic()`` when it came to be kept by its names alone (its ``orphan_ttl`` counts from then).
    orphaned_at: float | None = None
    #: The owner revoked it: no new opens, and each holder's next use of it answers REVOKED.
    revoked: bool = False
    #: Published ``persistent``: no ``orphan_ttl``, and parked where a service manager keeps fds
    #: (model weights that outlive their loader and survive the daemon's restarts).
    persistent: bool = False
    #: Published ``once``: consume-once, its names stop keeping it once a session opened it after its
    #: owner let go (the names of other shares keep theirs however often they are opened).
    once: bool = False
    #: Digest checks of its bytes queued or running (:mod:`cuctxd.daemon.device.digest_checks`): they keep it.
    checks: int = 0
    #: An older version of a versioned name re-adopted at start: kept, as by a name, until a session holds it
    #: (the processes that mapped it before the restart may hold it again) or ``orphan_ttl`` passes.
    retained: bool = False

    @property
    def share_id(self) -> str:
        return self.descriptor.share_id

    @property
    def footprint(self) -> int:
        """What its memory takes of the device (:meth:`MemoryKind.footprint`): what a hold or an orphan costs."""
        return self.kind.footprint(self.descriptor.size)

    def keeps_alive(self) -> bool:
        if self.owner_present or self.holders or self.checks:
            return True
        return (bool(self.names) or self.retained) and not (self.once and self.opened_since_orphaned)


@dataclass(eq=False)
class Buffer:
    """A device allocation of one session, made in ``context``."""

    handle: int
    ptr: int
    size: int
    context: SessionContext
    kind: MemoryKind
    share: Share | None = None
    #: The id of its allocation once exported (the share descriptor's ``buffer_id``), kept with a spare.
    buffer_id: str = ""
    #: The versioned name whose spare it is (:mod:`cuctxd.daemon.device.spares`), else "": it holds an older
    #: version of that name, so it is published only as that name's next version, and a free that is not a
    #: share's settle (which scrubs) sets it to zero first, as every shared memory is before it is freed.
    spare_of: str = ""

    @property
    def footprint(self) -> int:
        """What it takes of the device, what the session quota charges (:meth:`MemoryKind.footprint`)."""
        return self.kind.footprint(self.size)


@dataclass(eq=False)
class StreamEntry:
    """A session's stream, made in ``context``."""

    handle: int
    stream: Stream
    context: SessionContext
    non_blocking: bool


@dataclass(eq=False)
class EventEntry:
    """A session's event, made in ``context``."""

    handle: int
    event: Event
    context: SessionContext
    timing: bool


#: A recorded marker: the context it lives in and the event to poll.
Marker = tuple[SessionContext, Event]


@dataclass(eq=False)
class HostBuffer:
    """A session's shared host buffer; ``view`` is the daemon's mapping, registered (portable) in ``context``,
    the session's primary: it serves every context of the device and outlives the ones the session creates."""

    handle: int
    size: int
    memory: mmap.mmap
    view: memoryview
    context: SessionContext
    #: Markers of stream-ordered copies that use it, recorded since the last check.
    busy: list[Marker] = field(default_factory=list)
    #: The fds its mapping (and ``memfd``) hold, counted in the daemon's fd budget until it is unmapped.
    charge: FdCharge | None = None
    #: The daemon's own fd of the memfd, where the buffer may be kept registered once freed (to hand out again).
    memfd: int | None = None
    #: Its bytes in 2 MiB pages (:mod:`cuctxd.daemon.device.huge_pages`).
    huge_page_bytes: int = 0


@dataclass
class SessionOnDevice:
    """A session's view of one device: its context stack, contexts, buffers, streams, events, holds."""

    ref: SessionRef
    device: int
    stack: list[SessionContext] = field(default_factory=list)
    contexts: HandleTable[SessionContext] = field(init=False)
    buffers: HandleTable[Buffer] = field(init=False)
    streams: HandleTable[StreamEntry] = field(init=False)
    events: HandleTable[EventEntry] = field(init=False)
    host_buffers: HandleTable[HostBuffer] = field(init=False)
    #: Share id -> how many times this session holds it open.
    holds: dict[str, int] = field(default_factory=dict)
    primary: SessionContext | None = None
    bytes_allocated: int = 0
    #: Bytes of the shares this session holds open that its quota pays for (:meth:`Sharing.charges`).
    bytes_held: int = 0
    #: Shares made from this session's buffers that are still alive (its exports).
    exports: int = 0
    #: Shares revoked while this session held them: its next open or close of one answers REVOKED.
    revoked: set[str] = field(default_factory=set)
    #: Bytes of this session's host buffers here (``host_memory_per_session``), those being made included.
    host_bytes: int = 0
    #: Its host buffers still being made (memfd and 2 MiB pages ready, not registered yet): objects already.
    host_making: int = 0
    #: Errors of failed stream-ordered entries by their handle (oldest first, at most
    #: MAX_DEFERRED_ERRORS), and the first one not yet reported by a synchronize.
    deferred: dict[int, CuctxError] = field(default_factory=dict)
    first_deferred: CuctxError | None = None
    #: Its ``wait_version`` requests waiting here (at most MAX_VERSION_WAITERS).
    version_waiters: int = 0

    def __post_init__(self) -> None:
        self.contexts = HandleTable("context", self.device)
        self.buffers = HandleTable("buffer", self.device, self.deferred)
        self.streams = HandleTable("stream", self.device)
        self.events = HandleTable("event", self.device)
        self.host_buffers = HandleTable("host buffer", self.device)

    def defer(self, handle: int, error: CuctxError) -> None:
        """A stream-ordered entry naming ``handle`` failed: keep the error for whoever asks next."""
        self.deferred.pop(handle, None)
        self.deferred[handle] = error
        if len(self.deferred) > MAX_DEFERRED_ERRORS:
            del self.deferred[next(iter(self.deferred))]
        if self.first_deferred is None:
            self.first_deferred = error

    def raise_deferred(self) -> None:
        """A synchronize reports the first stream-ordered failure since the last one did."""
        error, self.first_deferred = self.first_deferred, None
        if error is not None:
            raise error

    def object_count(self) -> int:
        """What ``max_objects_per_session`` counts: created contexts (not the shared primary),
        buffers, streams, events, host buffers (those being made too) and distinct shares held open."""
        return (self.created_contexts() + len(self.buffers) + len(self.streams) + len(self.events)
                + len(self.host_buffers) + self.host_making + len(self.holds))

    def share_count(self) -> int:
        """What ``max_shares_per_session`` counts: live exports, distinct shares held open, and shares
        revoked from under it that it has not closed yet."""
        return self.exports + len(self.holds) + len(self.revoked)

    def created_contexts(self) -> int:
        """Contexts this session created here (``max_contexts_per_session``; the primary is not one)."""
        return len(self.contexts) - (1 if self.primary is not None else 0)

    def bytes_charged(self) -> int:
        """What the session quota counts: bytes allocated plus bytes of shares held that it pays for."""
        return self.bytes_allocated + self.bytes_held

    def check_quota(self, quota: int, size: int, what: str) -> None:
        """``CUDA_ERROR_OUT_OF_MEMORY`` if ``size`` more bytes would pass ``quota`` (0: none), allocations
        and shares held counted (``what``: "allocate", "hold open a share of")."""
        if quota and self.bytes_charged() + size > quota:
            raise CudaError.of(
                CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                f"session quota of {quota} bytes on device {self.device}: {self.bytes_allocated} allocated "
                f"and {self.bytes_held} held in shares, asked to {what} {size} more",
            )

    def check_room(self, limit: int, what: str) -> None:
        """Raise :class:`LimitExceeded` if the session may not have one more object (``what``); 0: no limit."""
        if limit and self.object_count() >= limit:
            raise LimitExceeded(
                f"max_objects_per_session: the session already holds {self.object_count()} of {limit} "
                f"objects (contexts, buffers, streams, events, shares held) on device {self.device}; "
                f"free some before making another {what}"
            )


def check_limit(name: str, limit: int, used: int, what: str, device: int) -> None:
    """Raise :class:`LimitExceeded` naming ``name`` if one more ``what`` would pass ``limit`` (0: none)."""
    if limit and used >= limit:
        raise LimitExceeded(f"{name}: the session already has {used} of {limit} {what} on device {device}")


def check_range(size_of_buffer: int, offset: int, size: int | None) -> int:
    """Validate ``[offset, offset+size)`` inside a buffer; return the resolved size."""
    if offset > size_of_buffer:
        raise OutOfRange(f"offset {offset} is past the end of a {size_of_buffer}-byte buffer")
    if size is None:
        size = size_of_buffer - offset
    if size > MAX_HANDLE or offset + size > size_of_buffer:
        raise OutOfRange(f"range [{offset}, {offset + size}) is outside a {size_of_buffer}-byte buffer")
    return size
