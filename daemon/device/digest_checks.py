"""Checking a published layout's digest against its bytes on the device (``verify_shared``).

A digest that anyone other than its publisher's uid relies on must have been computed or verified by the
daemon (PROTOCOL.md, section 9, "Digests"): a publisher states digests, and another uid could state the
digests of weights it does not hold. So the first time a session of another uid relies on a name's digest,
the daemon hashes the layout's bytes as the client does when it publishes (:mod:`cuctxd.protos.digests`:
each tensor cut into 2 MiB leaves from its first byte) and remembers the verdict with the name
(:meth:`~cuctxd.daemon.registry.shares.ShareRegistry.vouch`); later reliances read it.

A version of a name published without a digest (its tensors copied device to device, which no host hashed)
gets one from the daemon: :meth:`DigestChecks.compute` hashes it the same way once it is published, and the
version carries the digests from then on (:meth:`~cuctxd.daemon.registry.shares.ShareRegistry.digested`),
vouched for by the daemon; a reliance on it meanwhile waits for that result.

How, without holding up the device's other sessions: the leaves are grouped into chunks of at most
:data:`CHUNK_BYTES` of the buffer; each chunk is copied (``cuMemcpyDtoHAsync`` on a stream of the share's
context) into a free slot of a ring of :data:`SLOTS` page-locked staging buffers, and once its event has
passed its leaves are hashed on helper threads (xxhash releases the GIL) while the next chunks are copied. The
worker only issues copies and queries events, from the waiting requests' ``Pending.done`` between other
requests. One check runs at a time per device (the ring exists only while one runs); a reliance on a layout
being checked, or queued, waits for that same result.

Worker thread: every method, and every driver call. The helper threads (a pool per running check) plan the
chunks from the manifest, hash the ring's bytes and sum the layout's digest up; they never call the driver,
and wake the worker through its doorbell when they are done.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cuctxd.daemon.backends.base import Driver, Event, Stream
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import Share
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos import digests
from cuctxd.protos.errors import CuctxError, DigestMismatch, InternalError, NotFound
from cuctxd.protos.layouts import Manifest, c_strides, check_manifest
from cuctxd.protos.limits import DIGEST_CHECK_CHUNK_BYTES, DIGEST_CHECK_SLOTS

log = logging.getLogger(__name__)

#: Bytes of the buffer one staging slot holds: whole leaves, so a chunk is hashed by one helper.
CHUNK_BYTES = DIGEST_CHECK_CHUNK_BYTES
#: Staging slots of the ring: its page-locked bytes are ``SLOTS * CHUNK_BYTES``, held only while a check runs.
SLOTS = DIGEST_CHECK_SLOTS
#: Most helper threads hashing a chunk each.
MAX_HASH_THREADS = 8


@dataclass(frozen=True)
class Chunk:
    """``size`` bytes of the buffer from ``start``, copied in one go, and the leaves in them: ``(tensor index,
    offset in the buffer, bytes)`` each."""

    start: int
    size: int
    leaves: tuple[tuple[int, int, int], ...]


def plan_chunks(manifest: Manifest, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """The layout's leaves (as :func:`cuctxd.protos.digests.tensor_digest` cuts each tensor) by offset, in chunks
    of at most ``chunk_bytes`` of the buffer. :class:`DigestMismatch` for a tensor that is not C-contiguous: its
    digest (of its bytes as a client holds them) is not a function of one span of the buffer."""
    leaves: list[tuple[int, int, int]] = []
    for index, tensor in enumerate(manifest.tensors):
        if tensor.nbytes and tensor.strides != c_strides(tensor.shape):
            raise DigestMismatch(f"tensor {tensor.name!r} has strides {tensor.strides}: only a layout of contiguous "
                                 "tensors can have its digest checked")
        leaves.extend((index, tensor.offset + at, min(digests.LEAF_BYTES, tensor.nbytes - at))
                      for at in range(0, tensor.nbytes, digests.LEAF_BYTES))
    leaves.sort(key=lambda leaf: leaf[1])
    chunks: list[Chunk] = []
    group: list[tuple[int, int, int]] = []
    start = end = 0
    for leaf in leaves:
        if group and max(end, leaf[1] + leaf[2]) - start > chunk_bytes:
            chunks.append(Chunk(start, end - start, tuple(group)))
            group = []
        if not group:
            start = end = leaf[1]
        group.append(leaf)
        end = max(end, leaf[1] + leaf[2])
    if group:
        chunks.append(Chunk(start, end - start, tuple(group)))
    return chunks


def hash_chunk(view: memoryview, chunk: Chunk) -> list[bytes]:
    """The digests of the chunk's leaves, from its bytes in ``view`` (from ``chunk.start``); any thread."""
    return [digests.leaf(view[offset - chunk.start:offset - chunk.start + size]) for _, offset, size in chunk.leaves]


@dataclass(eq=False)
class DigestCheck:
    """One layout's check: the name and what it was published with, the share, and once ``finished``, the verdict
    (``matched``) or the failure (``error``) that every request waiting for it gets. ``computed``: a check that
    finds the digest of a version published without one (:meth:`DigestChecks.compute`); once finished, its
    ``naming`` with the digests found."""

    share: Share
    name: str
    naming: Naming
    owner: SessionRef
    computes: bool = False
    #: A reliance waits for it (a check of a version's digest runs at once then, not only while the device idles).
    waited_on: bool = False
    finished: bool = False
    matched: bool = False
    error: CuctxError | None = None
    computed: Naming | None = None

    def outcome(self, digest: str) -> str:
        """``"daemon"`` for ``digest`` where the bytes bear it out; else raises the check's failure or its
        mismatch."""
        if self.error is not None:
            raise self.error
        if self.computes:
            found = None if self.computed is None else self.computed.digest
            if found != digest:
                raise DigestMismatch(f"{self.name!r} holds {found or 'a layout without a digest'} (the daemon hashed "
                                     f"its bytes), not the required {digest}")
            return "daemon"
        if not self.matched:
            raise mismatch(self.name, self.naming, self.owner)
        return "daemon"


def mismatch(name: str, naming: Naming, owner: SessionRef) -> DigestMismatch:
    """The failure of a reliance on a digest the daemon found the bytes do not bear out, naming their publisher."""
    uid = "uid unknown (tcp://)" if owner.uid is None else f"uid {owner.uid}"
    return DigestMismatch(f"{name!r} was published by session {owner.public_id} ({owner.client!r}, {uid}) with the "
                          f"digest {naming.digest}, which its bytes on the device do not have (the daemon hashed "
                          "them): do not rely on it")


@dataclass(eq=False)
class _Slot:
    view: memoryview
    event: Event
    chunk: Chunk | None = None
    hashing: Future[list[bytes]] | None = None


@dataclass(eq=False)
class _Run:
    """The check in progress: its plan (made on a helper), the chunks left, the ring it copies them through,
    the leaves' digests so far, and the layout's digest (summed up on a helper)."""

    check: DigestCheck
    hashers: ThreadPoolExecutor
    planning: Future[tuple[Manifest, list[Chunk]]]
    manifest: Manifest | None = None
    chunks: deque[Chunk] = field(default_factory=deque)
    stream: Stream | None = None
    slots: list[_Slot] = field(default_factory=list)
    #: The leaves' digests so far, by tensor index: ``(offset in the buffer, digest)`` each.
    by_tensor: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    summing: Future[Manifest] | None = None


def _plan(manifest: bytes, size: int) -> tuple[Manifest, list[Chunk]]:
    """The manifest decoded and its chunks planned (a helper thread: a layout may list 100,000 tensors)."""
    decoded = check_manifest(manifest, size)
    return decoded, plan_chunks(decoded)


def _layout_of(manifest: Manifest, by_tensor: dict[int, list[tuple[int, bytes]]]) -> Manifest:
    """The manifest with each tensor's digest, of its leaves' digests, and the layout's (a helper thread)."""
    found = [digests.from_leaves(leaf for _, leaf in sorted(by_tensor.get(index, [])))
             for index in range(len(manifest.tensors))]
    return Manifest.digested(tuple(dataclasses.replace(tensor, digest=digest)
                                   for tensor, digest in zip(manifest.tensors, found, strict=True)),
                             manifest.metadata)


class DigestChecks:
    """The device's digest checks: one running, the rest queued (module docstring). Worker thread."""

    def __init__(self, driver: Driver, device: int, current: CurrentContext, registry: ShareRegistry,
                 shares: Mapping[str, Share], settle: Callable[[Share], None]) -> None:
        """``shares`` and ``settle``: the device's :class:`~cuctxd.daemon.device.sharing.Sharing`'s table, and
        its ``settle`` for a share a check no longer keeps alive."""
        self.driver = driver
        self.device = device
        self.current = current
        self.registry = registry
        self.shares = shares
        self.settle = settle
        self.queued: deque[DigestCheck] = deque()
        self.running: _Run | None = None
        #: Checks by (share id, name, naming), queued or running: a second reliance joins the first.
        self._open: dict[tuple[str, str, Naming], DigestCheck] = {}
        #: Checks finished (``checked``), those whose bytes differed (``mismatches``), and bytes hashed.
        self.checked = 0
        self.mismatches = 0
        #: Versions published without a digest that carry the daemon's now.
        self.computed = 0
        self.bytes_hashed = 0
        #: Wakes the worker when a helper finished a chunk (set by the worker; any thread may call it), so the
        #: next chunk is copied at once instead of at the worker's next poll of its pending work.
        self.wake: Callable[[], None] | None = None

    def rely(self, caller: SessionRef, name: str, digest: str) -> str | DigestCheck:
        """``caller`` relies on ``name``'s layout digest ``digest``: who vouches for it (``"publisher"``: the
        caller's own uid published it; ``"daemon"``: checked before), or the check to wait for. Raises
        :class:`NotFound` (no such name on this device) or :class:`DigestMismatch` (another digest, or bytes
        found to differ)."""
        share_id, naming, owner, vouched = self.registry.relied_on(name, self.device)
        computing = self._open.get((share_id, name, naming)) if naming.digest is None else None
        if computing is not None:
            computing.waited_on = True
            return computing
        if naming.digest != digest:
            raise DigestMismatch(f"{name!r} holds {naming.digest or 'a layout without a digest'}, not the "
                                 f"required {digest}")
        if caller.token == owner.token or (caller.uid is not None and caller.uid == owner.uid):
            return "publisher"
        if vouched is not None:
            if not vouched:
                raise mismatch(name, naming, owner)
            return "daemon"
        key = (share_id, name, naming)
        check = self._open.get(key)
        if check is not None:
            return check
        share = self.shares.get(share_id)
        if share is None:
            raise NotFound(f"{name!r} is not published on device {self.device}: look it up again")
        check = self._open[key] = DigestCheck(share, name, naming, owner)
        share.checks += 1
        self.queued.append(check)
        return check

    def compute(self, share: Share, name: str, naming: Naming, owner: SessionRef) -> None:
        """Find the digest of version ``share`` of ``name``, published with ``naming`` (a manifest, no digest),
        in the background: the worker moves it on while :meth:`busy`; the version carries it once found."""
        key = (share.share_id, name, naming)
        if key in self._open:
            return
        check = self._open[key] = DigestCheck(share, name, naming, owner, computes=True)
        share.checks += 1
        self.queued.append(check)

    def busy(self) -> bool:
        """Whether a check runs or waits: the worker moves them on between requests."""
        return self.running is not None or bool(self.queued)

    def poll(self, check: DigestCheck) -> bool:
        """Move the checks on (copies issued, events queried, hashes collected); whether ``check`` finished."""
        if not check.finished:
            self.advance()
        return check.finished

    def advance(self, idle: bool = True) -> None:
        """One step of the running check, or start the next one: never waits on the device or the helpers.
        ``idle``: the device has served no request for a while (the worker's loop says); without it a check of a
        version's digest (:meth:`compute`) holds still, taking nothing from the requests being served, unless a
        reliance waits for it (:meth:`poll` moves it on). Checks of versions freed meanwhile end either way."""
        self._give_up_unwanted()
        if self.running is None and self.queued and (idle or not self.queued[0].computes):
            self._start(self.queued.popleft())
        run = self.running
        if run is None or (run.check.computes and not idle and not run.check.waited_on):
            return
        check = run.check
        try:
            if run.manifest is None and not self._planned(run):
                return
            self.current.activate(check.share.context)
            for slot in run.slots:
                self._step(run, slot)
            if run.chunks and len(run.slots) < SLOTS and all(slot.chunk is not None for slot in run.slots):
                run.slots.append(_Slot(self.driver.mem_alloc_host(CHUNK_BYTES), self.driver.event_create(False)))
                self._step(run, run.slots[-1])  # the ring grows a slot a step: pinning is not free either
            if not run.chunks and all(slot.chunk is None for slot in run.slots):
                self._verdict(run)
        except CuctxError as exc:
            self._end(run, error=exc)
        except Exception as exc:  # a bug: its waiters get INTERNAL, the device goes on
            log.exception("device %d: checking the digest of %r failed", self.device, check.name)
            self._end(run, error=InternalError(f"checking the digest failed: {type(exc).__name__}"))

    def _give_up_unwanted(self) -> None:
        """End the checks of versions whose last holder let go (nobody can rely on their digest): they no longer
        keep the memory."""
        run = self.running
        if run is not None and run.check.computes and not _wanted(run.check.share):
            self._end(run, error=NotFound(f"the version of {run.check.name!r} was freed before its digest was found"))
        for check in [check for check in self.queued if check.computes and not _wanted(check.share)]:
            self.queued.remove(check)
            self._finish(check, error=NotFound(f"the version of {check.name!r} was freed before it was hashed"))

    def _helper(self, hashers: ThreadPoolExecutor, work: Callable[..., Any], *args: Any) -> Future[Any]:
        """``work(*args)`` on the running check's helpers; the worker is woken when it is done."""
        future = hashers.submit(work, *args)
        wake = self.wake
        if wake is not None:
            future.add_done_callback(lambda _: wake())
        return future

    def _start(self, check: DigestCheck) -> None:
        """The next check runs: its helpers start by planning it."""
        threads = min(MAX_HASH_THREADS, len(os.sched_getaffinity(0)), SLOTS)
        hashers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"cuctxd-verify-{self.device}")
        planning = self._helper(hashers, _plan, check.naming.manifest, check.share.descriptor.size)
        self.running = _Run(check, hashers, planning)

    def _planned(self, run: _Run) -> bool:
        """Once the plan is made: the stream and the ring's first slot, made in the share's context."""
        if not run.planning.done():
            return False
        run.manifest, chunks = run.planning.result()  # a layout that cannot be checked raises its error here
        run.chunks = deque(chunks)
        self.current.activate(run.check.share.context)
        run.stream = self.driver.stream_create(non_blocking=True)
        run.slots.append(_Slot(self.driver.mem_alloc_host(CHUNK_BYTES), self.driver.event_create(False)))
        log.info("device %d: %s of %r (%d bytes in %d chunks)", self.device,
                 "finding the digest" if run.check.computes else "checking the digest for a session of another uid",
                 run.check.name, sum(chunk.size for chunk in chunks), len(chunks))
        return True

    def _step(self, run: _Run, slot: _Slot) -> None:
        """Move one slot on: its hashed chunk's leaves collected, its copied chunk handed to a helper, or the
        next chunk copied into it."""
        if slot.hashing is not None:
            if not slot.hashing.done():
                return
            assert slot.chunk is not None
            for (tensor, offset, _), digest in zip(slot.chunk.leaves, slot.hashing.result(), strict=True):
                run.by_tensor.setdefault(tensor, []).append((offset, digest))
            self.bytes_hashed += sum(size for _, _, size in slot.chunk.leaves)
            slot.chunk = slot.hashing = None
        if slot.chunk is not None:
            if self.driver.event_query(slot.event):
                slot.hashing = self._helper(run.hashers, hash_chunk, slot.view, slot.chunk)
            return
        if run.chunks:
            slot.chunk = run.chunks.popleft()
            self.driver.memcpy_dtoh_async(slot.view, run.check.share.ptr + slot.chunk.start, slot.chunk.size,
                                          run.stream)
            self.driver.event_record(slot.event, run.stream)

    def _verdict(self, run: _Run) -> None:
        """Every leaf hashed: the layout's digest summed up on a helper, then compared."""
        if run.summing is None:
            assert run.manifest is not None
            run.summing = self._helper(run.hashers, _layout_of, run.manifest, run.by_tensor)
        if not run.summing.done():
            return
        found = run.summing.result()
        check = run.check
        if check.computes:
            check.computed = Naming(found.pack(), len(found.tensors), check.naming.read_only, found.digest)
            self._end(run, matched=True)
            return
        matched = found.digest == check.naming.digest
        if not matched:
            owner = run.check.owner
            log.warning("device %d: the digest of %r does not match its bytes: its publisher, session %d (%r, uid "
                        "%s, pid %s), stated %s", self.device, run.check.name, owner.public_id, owner.client,
                        owner.uid, owner.pid, run.check.naming.digest)
        self._end(run, matched=matched)

    def _end(self, run: _Run, *, matched: bool = False, error: CuctxError | None = None) -> None:
        """The running check is over: its copies waited for (a failed one's), the ring freed, its waiters told."""
        self.running = None
        run.hashers.shutdown(wait=True, cancel_futures=True)
        if run.stream is not None:
            try:
                self.current.activate(run.check.share.context)
                self.driver.stream_synchronize(run.stream)
            except CuctxError as exc:
                error = error or exc
            self._release(run.stream, run.slots)
        self._finish(run.check, matched=matched, error=error)

    def _release(self, stream: Stream, slots: list[_Slot]) -> None:
        for slot in slots:
            self.driver.event_destroy(slot.event)
            self.driver.mem_free_host(slot.view)
        self.driver.stream_destroy(stream)

    def _finish(self, check: DigestCheck, *, matched: bool = False, error: CuctxError | None = None) -> None:
        check.finished, check.matched, check.error = True, matched, error
        self._open.pop((check.share.share_id, check.name, check.naming), None)
        if error is None and check.computed is not None:
            self.computed += self.registry.digested(check.name, check.share.share_id, check.naming, check.computed)
        elif error is None:
            self.checked += 1
            self.mismatches += not matched
            self.registry.vouch(check.name, check.share.share_id, check.naming, matched)
        elif check.computes and not isinstance(error, NotFound):
            log.warning("device %d: the digest of %r could not be found: %s", self.device, check.name, error)
        check.share.checks -= 1
        self.settle(check.share)

    def status(self) -> dict[str, Any]:
        """For ``status``: checks done, mismatches found, digests found, bytes hashed, and what runs or waits
        now."""
        return {"checked": self.checked, "mismatches": self.mismatches, "computed": self.computed,
                "bytes_hashed": self.bytes_hashed,
                "running": None if self.running is None else self.running.check.name, "queued": len(self.queued),
                "staging_bytes": 0 if self.running is None else len(self.running.slots) * CHUNK_BYTES}


def _wanted(share: Share) -> bool:
    """Whether anything but a check keeps the share: its owner, a holder, a name, or a restart's retention."""
    return share.owner_present or bool(share.holders) or bool(share.names) or share.retained
