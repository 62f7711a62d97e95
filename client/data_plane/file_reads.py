"""File ranges into a daemon buffer at the storage and DMA limits, hashed on the way: what ``cuctx load`` moves.

:func:`load_file_ranges` reads each :class:`FileRange` (a tensor's bytes in a checkpoint file) into
the buffer at its offset and returns each range's digest (:mod:`cuctxd.protos.digests`), computed from
the bytes while they are in the staging memory, never by a second read.

The ranges are packed into chunks (a slot's worth of consecutive buffer bytes, :func:`plan_chunks`).
A host buffer of :data:`SLOT_BYTES` slots, :func:`reader_threads` plus :data:`SPARE_SLOTS`, is shared with
the daemon (asked with ``reuse``: the daemon keeps a freed ring page-locked for the next load, since
page-locking 128 MiB costs 60-90 ms); reader threads each fill a slot with ``pread`` (from the page cache:
the kernel copies, no faults on a mapping; on the H200 host 16 threads read 44 GB/s, a mapping copied on 8
threads 33 GB/s), a digest leaf at a time, each leaf hashed as soon as it is read (while it is in the
CPU's cache: 0.30 thread-seconds of hashing for a 2.8 GB load on the H100 host, against 0.40 hashing each
8 MiB slot after reading it), while the calling thread sends each filled slot's DMA (``memcpy_htod``) in order, on
the socket, where many wait at once (on an shm lane each waited for the one before: 1 ms a chunk on the
H200 host), and hands a slot back once its DMA is answered. A chunk whose file bytes are mostly not in the page
cache (``mincore``) is read with ``O_DIRECT`` into its slot and its pieces moved into place there (on
the H200 host's disk 2.31 GB/s against 1.96 GB/s buffered), in :data:`DIRECT_STEP` reads the readers take
in file order. Without a data plane (tcp://) the ranges
go as payload frames instead (:func:`~cuctxd.client.data_plane.transfers.write_pieces`).

Which thread may call: the client's callers (one load at a time per client); the readers are threads of
the call, gone when it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.host_buffers import HostBuffer
from cuctxd.client.data_plane.owner import SyncOwner
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Local, Plan, Request, Send, Wait
from cuctxd.protos import digests
from cuctxd.protos.errors import CuctxError
from cuctxd.protos.host import buffer_address

#: Buffer bytes one slot carries (one DMA). A multiple of the digest's leaf, so that a tensor cut between
#: chunks is cut at a leaf's edge.
SLOT_BYTES = 8 << 20
#: ``O_DIRECT`` reads whole aligned blocks: a slot has room for a block's worth before and after its chunk.
BLOCK = 4096
SLOT_SPAN = SLOT_BYTES + 2 * BLOCK
#: Most reader threads. On the H200 host (16 CPUs) 8 loaded a 2.5 GB file from the page cache in 0.088 s
#: and 16 in 0.12 s (the daemon and the DMA need CPUs too); from the disk both read 2.0 GB/s.
MAX_READERS = 8
#: Slots beyond one per reader: filled chunks waiting for their turn, and DMAs not yet answered. On the H100
#: host (8 readers, 2.8 GB from the page cache) the reads took 0.17 s with 1 spare slot, 0.15 s with 5 and
#: 0.13 s with 9 (the readers waited less for a slot).
SPARE_SLOTS = 8
#: Below this share of a chunk's file pages in the page cache, it is read with ``O_DIRECT``.
DIRECT_BELOW = 0.5
#: ``O_DIRECT`` reads of this size, dealt to the readers in file order, so that the disk sees one stream with
#: ``MAX_READERS`` steps (8 MiB) in flight rather than 8 streams of whole 8 MiB chunks (64 MiB). Evicted 2.7 GB
#: on the 2-CPU VM (virtio), 8 rounds each: 3.26-3.84 GB/s against 3.39-3.50; on the H100 host 16 readers of
#: 1 MiB in file order read 2.04 and 2.53 GB/s against 1.92 and 1.72 (``bench/RESULTS.md``).
DIRECT_STEP = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes at ``offset`` of the open file ``fd``, for the buffer at ``device_offset``."""

    fd: int
    offset: int
    nbytes: int
    device_offset: int


@dataclass(frozen=True)
class Piece:
    """The part of range ``index`` (from its byte ``start``) a chunk carries, at ``place`` in the chunk."""

    index: int
    fd: int
    file_offset: int
    nbytes: int
    place: int
    start: int


@dataclass
class Chunk:
    """Consecutive buffer bytes from ``device_offset``, filled from its pieces, sent as one DMA."""

    device_offset: int
    size: int = 0
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class _Fill:
    """A slot being filled: ``image``, where the chunk's image starts in the slot, once it is there; the
    reader tasks that write into the slot, all of which must be done or cancelled before it is reused."""

    image: Future[int]
    tasks: list[Future[Any]]

    def cancel(self) -> None:
        """Cancel the tasks not yet begun (the calling thread)."""
        for task in self.tasks:
            task.cancel()

    def wait(self) -> None:
        """Wait for the tasks that began, whatever they raise (the calling thread)."""
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                task.result()


def reader_threads() -> int:
    """Threads reading at once: the CPUs this process may run on, at most :data:`MAX_READERS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_READERS, cpus))


def plan_chunks(ranges: Sequence[FileRange], slot: int = SLOT_BYTES,
                gap: int = transfers.GAP_BYTES) -> Iterator[Chunk]:
    """Pack the ranges (ascending by ``device_offset``) into chunks of at most ``slot`` buffer bytes;
    ranges less than ``gap`` apart share a chunk, and a range longer than what is left of a chunk is cut
    at a multiple of the digest's leaf from its start (a range longer than a slot spans chunks)."""
    chunk: Chunk | None = None
    for index, item in enumerate(ranges):
        done = 0
        while done < item.nbytes or (item.nbytes == 0 and done == 0):
            at = item.device_offset + done
            if chunk is not None and (at - chunk.device_offset - chunk.size > gap
                                      or at - chunk.device_offset >= slot):
                yield chunk
                chunk = None
            room = slot - (at - chunk.device_offset) if chunk is not None else slot
            left = item.nbytes - done
            if chunk is not None and left > room and room < digests.LEAF_BYTES:
                yield chunk
                chunk = None
                room = slot
            if chunk is None:
                chunk = Chunk(at)
            size = left if left <= room else room - room % digests.LEAF_BYTES
            chunk.pieces.append(Piece(index, item.fd, item.offset + done, size, at - chunk.device_offset, done))
            chunk.size = at - chunk.device_offset + size
            done += size
            if item.nbytes == 0:
                break
    if chunk is not None:
        yield chunk


def _hash_piece(leaves: list[bytes], piece: Piece, data: memoryview) -> None:
    """The digests of the leaves of range ``piece.index`` that ``data`` (the piece's bytes) holds."""
    for step in range(0, piece.nbytes, digests.LEAF_BYTES):
        leaves[(piece.start + step) // digests.LEAF_BYTES] = digests.leaf(data[step:step + digests.LEAF_BYTES])


def _read_exactly(fd: int, into: memoryview, offset: int, at_least: int | None = None) -> None:
    """Fill ``into`` from ``offset``, or its first ``at_least`` bytes (an ``O_DIRECT`` read of whole blocks
    that may end with the file's last, partial one)."""
    needed = into.nbytes if at_least is None else at_least
    done = 0
    while done < needed:
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise EOFError(f"the file ended {needed - done} bytes early (at byte {offset + done})")
        done += got


class _Residency:
    """Which pages of the files are in the page cache (``mincore`` over a mapping of each, one chunk's
    pages at a time, on the reader threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[int, int | None] = {}
        self._exits = contextlib.ExitStack()
        self._libc = ctypes.CDLL(None, use_errno=True)

    def close(self) -> None:
        self._exits.close()

    def _address(self, fd: int) -> int | None:
        with self._lock:
            if fd not in self._maps:
                try:
                    mapped = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
                except (OSError, ValueError):  # empty, or not a file that maps
                    self._maps[fd] = None
                else:
                    self._exits.callback(mapped.close)
                    self._maps[fd] = self._exits.enter_context(buffer_address(mapped))
            return self._maps[fd]

    def share(self, fd: int, offset: int, nbytes: int) -> float:
        """The share of ``nbytes`` at ``offset`` in the page cache (1.0 where it cannot be told)."""
        address = self._address(fd)
        if address is None or nbytes == 0:
            return 1.0
        begin = offset - offset % mmap.PAGESIZE
        vector = ctypes.create_string_buffer(-(-(offset + nbytes - begin) // mmap.PAGESIZE))
        if self._libc.mincore(ctypes.c_void_p(address + begin), ctypes.c_size_t(offset + nbytes - begin), vector):
            return 1.0
        return 1.0 - vector.raw.count(0) / len(vector.raw)


class _Reader:
    """What the reader threads share: the slots' memory, the files' ``O_DIRECT`` twins, the leaf digests."""

    def __init__(self, host: Any, ranges: Sequence[FileRange], digest: bool) -> None:
        self.view = memoryview(host)
        self.digest = digest
        self.leaves: list[list[bytes]] = [[b""] * -(-r.nbytes // digests.LEAF_BYTES) for r in ranges]
        self.direct: dict[int, int | None] = {}
        self.residency = _Residency()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Once no reader runs."""
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)
        self.residency.close()
        self.view.release()

    def direct_twin(self, fd: int) -> int | None:
        """The file of ``fd`` opened again with ``O_DIRECT`` (None where the filesystem refuses it)."""
        with self._lock:
            if fd not in self.direct:
                try:
                    self.direct[fd] = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                except OSError:
                    self.direct[fd] = None
            return self.direct[fd]

    def plan_direct(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` is read with ``O_DIRECT``: one file, in order, and mostly not in the page cache."""
        if not hasattr(os, "O_DIRECT") or not chunk.pieces:
            return False
        first, last = chunk.pieces[0], chunk.pieces[-1]
        if any(p.fd != first.fd for p in chunk.pieces):
            return False
        span = last.file_offset + last.nbytes - first.file_offset
        if any(b.file_offset < a.file_offset + a.nbytes for a, b in zip(chunk.pieces, chunk.pieces[1:], strict=False)):
            return False  # out of file order: the pieces could not be moved into place within the slot
        if any(p.file_offset - first.file_offset > p.place for p in chunk.pieces):
            return False  # a file gap wider than the chunk's: the same
        if self.residency.share(first.fd, first.file_offset, span) >= DIRECT_BELOW:
            return False
        return self.direct_twin(first.fd) is not None

    def planned(self, pool: ThreadPoolExecutor, chunks: Iterable[Chunk],
                ahead: int) -> Iterator[tuple[Chunk, Future[bool]]]:
        """Each chunk with whether it is read with ``O_DIRECT``, asked of the readers ``ahead`` chunks before
        its turn (``mincore`` costs 0.11 ms per 8 MiB chunk on the 2-CPU VM, 38 ms for a 2.8 GB file: too
        much for the calling thread, which sends the DMAs)."""
        asked: deque[tuple[Chunk, Future[bool]]] = deque()
        for chunk in chunks:
            asked.append((chunk, pool.submit(self.plan_direct, chunk)))
            if len(asked) > ahead:
                yield asked.popleft()
        yield from asked

    def start(self, pool: ThreadPoolExecutor, slot: int, chunk: Chunk, direct: bool) -> _Fill:
        """Fill the slot at ``slot`` with ``chunk``'s bytes and hash them on the readers (the calling
        thread submits; the readers read). A chunk read with ``O_DIRECT`` goes as :data:`DIRECT_STEP`
        reads queued behind those of the chunks before it, so the readers take them in file order."""
        if not direct:
            image = pool.submit(self._fill_buffered, slot, chunk)
            return _Fill(image, [image])
        read = _DirectRead(self, slot, chunk)
        return _Fill(read.image, [pool.submit(read.step, at) for at in range(0, read.needed, DIRECT_STEP)])

    def _fill_buffered(self, slot: int, chunk: Chunk) -> int:
        """Each piece a leaf at a time, hashed as soon as it is read (while its bytes are in this CPU's
        cache: hashing the whole chunk after reading it fetched it from memory again). Smaller reads with a
        streaming hash, more readers and hashing threads apart from the readers were all slower on the H100
        host (``bench/RESULTS.md``, 2026-12-05). Returns 0: the chunk's image starts the slot."""
        for piece in chunk.pieces:
            leaves = self.leaves[piece.index]
            for step in range(0, piece.nbytes, digests.LEAF_BYTES):
                at = slot + piece.place + step
                with self.view[at:at + min(digests.LEAF_BYTES, piece.nbytes - step)] as into:
                    _read_exactly(piece.fd, into, piece.file_offset + step)
                    if self.digest:
                        leaves[(piece.start + step) // digests.LEAF_BYTES] = digests.leaf(into)
        return 0


class _DirectRead:
    """One chunk read with ``O_DIRECT``: whole aligned blocks from ``begin`` into the slot, a step per reader
    task; the task that reads the last step moves each piece to its place and hashes the chunk."""

    def __init__(self, reader: _Reader, slot: int, chunk: Chunk) -> None:
        first, last = chunk.pieces[0], chunk.pieces[-1]
        self.reader, self.slot, self.chunk = reader, slot, chunk
        self.begin = first.file_offset - first.file_offset % BLOCK
        self.needed = last.file_offset + last.nbytes - self.begin
        fd = reader.direct[first.fd]
        assert fd is not None, "planned for O_DIRECT only with its twin open"
        self.fd = fd
        self.image: Future[int] = Future()
        self._left = -(-self.needed // DIRECT_STEP)
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def step(self, at: int) -> None:
        """Read the step at ``at`` bytes from ``begin`` (a reader thread)."""
        failed: BaseException | None = None
        try:
            self._read(at)
        except BaseException as error:  # handed to whoever waits for the chunk
            failed = error
        with self._lock:
            self._failed = self._failed or failed
            self._left -= 1
            if self._left:
                return
        if self._failed is not None:
            self.image.set_exception(self._failed)
            return
        try:
            self.image.set_result(self._place())
        except BaseException as error:  # the same
            self.image.set_exception(error)

    def _read(self, at: int) -> None:
        needed = min(DIRECT_STEP, self.needed - at)
        start = self.slot + at
        with self.reader.view[start:start + -(-needed // BLOCK) * BLOCK] as into:
            _read_exactly(self.fd, into, self.begin + at, needed)

    def _place(self) -> int:
        """Move each piece to its place (places only grow faster than file offsets: a layout pads, a file
        does not), last piece first, and hash it; returns where the chunk's image starts in the slot."""
        reader, slot, begin = self.reader, self.slot, self.begin
        image = self.chunk.pieces[0].file_offset - begin
        with buffer_address(reader.view) as base:
            for piece in reversed(self.chunk.pieces):
                source = slot + piece.file_offset - begin
                target = slot + image + piece.place
                if source != target:
                    ctypes.memmove(base + target, base + source, piece.nbytes)
        if reader.digest:
            for piece in self.chunk.pieces:
                at = slot + image + piece.place
                with reader.view[at:at + piece.nbytes] as data:
                    _hash_piece(reader.leaves[piece.index], piece, data)
        return image


class Loader(SyncOwner, Protocol):
    """A sync client as a load sees it: it also makes the load ring (``Client.host_alloc``)."""

    def host_alloc(self, size: int, device: int | None = None, *, reuse: bool = False) -> HostBuffer: ...


def load_file_ranges(client: Loader, buffer: Any, ranges: Sequence[FileRange], *, digest: bool = True,
                     progress: Callable[[int, int], None] | None = None) -> list[str | None]:
    """Copy every range into ``buffer`` (ranges ascending by ``device_offset``, not overlapping; the bytes
    between ranges less than ``GAP_BYTES`` apart are overwritten); returns each range's digest (None
    without ``digest``). ``progress(done, total)`` in bytes. A short file raises :class:`EOFError`; what was
    written stays in the buffer, which the caller frees."""
    with _loading(client, buffer.device, ranges, buffer, None, digest, progress) as (_, found):
        return found


@contextlib.contextmanager
def load_into_new_buffer(client: Loader, allocate: Request[T], device: int, ranges: Sequence[FileRange], *,
                         digest: bool = True, progress: Callable[[int, int], None] | None = None
                         ) -> Iterator[tuple[T, list[str | None]]]:
    """:func:`load_file_ranges` into the buffer ``allocate`` makes on ``device``, sent before the first read
    so that its making overlaps the reads; gives the buffer and the digests to the ``with`` block, and the
    load ring back after it without waiting for the answer (so that neither what the block sends, a
    publish, nor the caller waits for the ring's unregistering: 15 ms for 72 MiB on the H200). Nothing stays
    allocated when the load raises; once the block has the buffer, it is the block's."""
    with _loading(client, device, ranges, None, allocate, digest, progress) as loaded:
        yield loaded


@contextlib.contextmanager
def _loading(client: Loader, device: int, ranges: Sequence[FileRange], buffer: Any, allocate: Request[Any] | None,
             digest: bool, progress: Callable[[int, int], None] | None) -> Iterator[tuple[Any, list[str | None]]]:
    chunks = list(plan_chunks(ranges))
    threads = min(reader_threads(), max(1, len(chunks)))
    try:
        host = client.host_alloc((threads + SPARE_SLOTS) * SLOT_SPAN, device, reuse=True)
    except (CuctxError, OSError):  # no data plane (tcp://), or over the session's host memory
        host = None
    if host is None:
        buffer = buffer if allocate is None else client.run(allocate)
        try:
            found = _load_through_writes(client, buffer, ranges, digest, progress)
        except BaseException:
            if allocate is not None:
                buffer.free()
            raise
        yield buffer, found
        return
    try:
        made = _load_through_ring(client, host, chunks, ranges, buffer, allocate, threads, digest, progress)
        yield made
    finally:
        host.free(wait=False)


def _load_through_ring(client: Loader, host: Any, chunks: list[Chunk], ranges: Sequence[FileRange], buffer: Any,
                       allocate: Request[Any] | None, threads: int, digest: bool,
                       progress: Callable[[int, int], None] | None) -> tuple[Any, list[str | None]]:
    """The load through the host buffer ``host`` (the load ring); the buffer made by ``allocate`` is freed
    when this raises."""
    reader = _Reader(host, ranges, digest)
    made: list[Any] = [buffer]
    total = sum(r.nbytes for r in ranges)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="cuctxd-load") as pool:
            client.run(_pipeline(made, allocate, host, chunks, reader, pool, threads + SPARE_SLOTS, total, progress))
    except BaseException:
        if allocate is not None and made[0] is not None:
            made[0].free()
        raise
    finally:
        reader.close()
    if not digest:
        return made[0], [None] * len(ranges)
    return made[0], [digests.from_leaves(leaves) for leaves in reader.leaves]


def _pipeline(made: list[Any], allocate: Request[Any] | None, host: Any, chunks: list[Chunk], reader: _Reader,
              pool: ThreadPoolExecutor, slots: int, total: int,
              progress: Callable[[int, int], None] | None) -> Plan[None]:
    """Slots filled by the readers, each DMA'd in chunk order once filled and reused once answered; the
    buffer (``made[0]``) made by ``allocate`` meanwhile when there is none yet."""
    making = (yield Send(allocate)) if allocate is not None else None
    free = deque(index * SLOT_SPAN for index in range(slots))
    filling: deque[tuple[int, Chunk, _Fill]] = deque()
    sent: deque[tuple[int, int, Any]] = deque()
    waiting = reader.planned(pool, chunks, slots)
    following = next(waiting, None)
    done = 0
    try:
        while True:
            while free and following is not None:
                chunk, planned = following
                direct = yield Local(planned.result)  # asked of the readers long before: rarely a wait
                slot = free.popleft()
                filling.append((slot, chunk, reader.start(pool, slot, chunk, direct)))
                following = next(waiting, None)
            if not filling and following is None:
                break
            if sent and (not filling or (not free and not filling[0][2].image.done())):
                slot, size, call = sent.popleft()  # a slot back, for the next chunk
                yield Wait(call)
                free.append(slot)
                done += size
                if progress is not None:
                    yield Local(partial(progress, done, total))
                continue
            slot, chunk, fill = filling.popleft()
            image = yield Local(fill.image.result)
            if making is not None:
                made[0], making = (yield Wait(making)), None
            call = yield Send(build.memcpy_htod(made[0], host, chunk.device_offset, slot + image, chunk.size, None),
                              many=True)
            sent.append((slot, sum(p.nbytes for p in chunk.pieces), call))
        if making is not None:  # nothing to read
            made[0] = yield Wait(making)
        while sent:
            slot, size, call = sent.popleft()
            yield Wait(call)
            done += size
        if progress is not None:
            yield Local(partial(progress, done, total))
    except BaseException:
        for _, _, fill in filling:  # all cancelled first: no reader takes another slot's steps meanwhile
            fill.cancel()
        for _, _, fill in filling:  # none may write into the slots once they are freed
            fill.wait()
        while sent:
            with contextlib.suppress(CuctxError):
                yield Wait(sent.popleft()[2])
        if making is not None:  # the buffer is made all the same: the caller frees it
            with contextlib.suppress(CuctxError):
                made[0] = yield Wait(making)
        raise


def _load_through_writes(client: Loader, buffer: Any, ranges: Sequence[FileRange], digest: bool,
                         progress: Callable[[int, int], None] | None) -> list[str | None]:
    """The ranges as ordinary writes, a bounded batch at a time: for clients without a data plane."""
    total = sum(r.nbytes for r in ranges)
    leaves: list[list[bytes]] = [[b""] * -(-r.nbytes // digests.LEAF_BYTES) for r in ranges]
    done = 0
    for chunk in plan_chunks(ranges):
        staging = memoryview(bytearray(chunk.size))
        pieces = []
        for piece in chunk.pieces:
            view = staging[piece.place:piece.place + piece.nbytes]
            _read_exactly(piece.fd, view, piece.file_offset)
            if digest:
                _hash_piece(leaves[piece.index], piece, view)
            pieces.append((chunk.device_offset + piece.place, view))
        done += client.run(transfers.write_pieces(client, buffer, [p for p in pieces if p[1].nbytes]))
        if progress is not None:
            progress(done, total)
    if not digest:
        return [None] * len(ranges)
    return [digests.from_leaves(each) for each in leaves]


__all__ = ["FileRange", "load_file_ranges", "load_into_new_buffer", "plan_chunks"]
