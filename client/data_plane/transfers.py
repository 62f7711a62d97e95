"""Host <-> device transfers, choosing the path: a host buffer, the staging ring, or the socket.

* From or to a :class:`~cuctxd.client.data_plane.host_buffers.HostBuffer`: one small request,
  the daemon copies by DMA (``memcpy_htod``/``memcpy_dtoh``).
* Ordinary bytes of at least :data:`RING_MIN_BYTES`, without a stream, over a
  client with a data plane: through the device's staging ring, a host buffer of
  :data:`RING_SLOTS` slots of :data:`RING_SLOT_BYTES`. The client copies the next
  slot (on several threads, :mod:`cuctxd.client.data_plane.host_copy`) while the daemon DMAs
  the one before; at most ``RING_SLOTS`` requests are out at once, and a slot is
  reused only after its request was answered. The chunk nothing overlaps (a
  write's last, a read's first) is kept short (:data:`EDGE_BYTES`). A write of
  one chunk (from :data:`EARLY_MIN_BYTES`) sends its request early on the shm
  lane, before its copy.
* Otherwise (small transfers, stream-ordered ones, tcp://): payload frames on the
  socket (:func:`cuctxd.client.wire.build.write` and friends).

Which thread may call: the client's callers; a ring serves one transfer at a time
(another one meanwhile takes the socket).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

from cuctxd.client.data_plane import host_copy
from cuctxd.client.data_plane.host_buffers import HostBufferFields, host_alloc
from cuctxd.client.data_plane.owner import Owner
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Local, OnDevice, Plan, Request, Send, Sized, Wait
from cuctxd.protos.errors import BadArgument, CuctxError

#: Bytes per slot of a staging ring, and slots per ring. Measured on the H200 host inside a 64 MiB
#: write: 16 MiB slots copied on 8 threads in 0.50 ms (34 GB/s), 8 MiB slots on 4 at 25 GB/s, and four
#: slots were slower than two (more memory touched), so slots are large and two suffice to overlap.
RING_SLOT_BYTES = 16 << 20
RING_SLOTS = 2
#: Smallest transfer that goes through the ring (below it, a payload frame costs less; bench figure 4).
RING_MIN_BYTES = 64 << 10
#: Largest gap between two pieces of :func:`write_pieces` that one DMA spans (a layout pads each
#: tensor to 256 bytes).
GAP_BYTES = 4096
#: Size of the chunk no copy can overlap, the last of a write (its DMA) and the first of a read (its
#: DMA), when a transfer is more than twice this: on the H200 host the last 16 MiB DMA of a 64 MiB
#: write, 0.6 of its 4 ms, ran while the client had nothing left to copy.
EDGE_BYTES = 4 << 20
#: Smallest one-chunk write whose request goes early, before its copy: below it the copy is shorter than
#: what the data ring costs (a syscall, a second look by the daemon). On the H200 host, early against
#: copy-then-request: 256 KiB 116 against 110 us, 1 MiB 178 against 197, 4 MiB 537 against 568.
EARLY_MIN_BYTES = 512 << 10


class StagingRing:
    """A device's staging ring: one host buffer cut into slots."""

    def __init__(self, host: HostBufferFields) -> None:
        self.host = host
        self.view = memoryview(host)
        self.busy = False

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Marks the ring busy for one transfer (another one meanwhile takes the socket)."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    @staticmethod
    def offset(index: int) -> int:
        """Where the slot of chunk ``index`` starts in the ring."""
        return (index % RING_SLOTS) * RING_SLOT_BYTES

    def copy_in(self, index: int, pieces: Sequence[tuple[int, memoryview]]) -> None:
        """Chunk ``index``'s pieces into its slot, each at its place in the slot (no view of the ring
        outlives the copy)."""
        at = self.offset(index)
        for place, data in pieces:
            with self.view[at + place:at + place + data.nbytes] as slot:
                host_copy.copy(slot, data)

    def copy_out(self, index: int, out: memoryview) -> None:
        at = self.offset(index)
        with self.view[at:at + out.nbytes] as slot:
            host_copy.copy(out, slot)

    def unmap(self) -> None:
        """Unmap here (the daemon frees its side with the session); a view still alive keeps the mapping
        until it goes, rather than failing the client's close."""
        self.view.release()
        with contextlib.suppress(BufferError):
            self.host.close()


def _check_device(buffer: OnDevice, host: HostBufferFields) -> None:
    if host.device != buffer.device:
        raise BadArgument(f"a host buffer made for device {host.device} cannot be copied to or from a buffer "
                          f"on device {buffer.device}; make one with host_alloc(size, device={buffer.device})")


def _ring(owner: Owner, device: int) -> Plan[StagingRing | None]:
    """The device's ring, made on first use; None when there is none to use now (no data plane, busy,
    or the session may not have one)."""
    plane = owner.data_plane(required=False)
    if plane is None:
        return None
    if device not in plane.rings:
        try:
            host = yield from host_alloc(owner, HostBufferFields, RING_SLOTS * RING_SLOT_BYTES, device, reuse=True)
        except (CuctxError, OSError):  # over the session's host memory limit, say: the socket it is
            plane.rings[device] = None
            return None
        plane.rings[device] = StagingRing(host)
    ring: StagingRing | None = plane.rings[device]
    if ring is None or ring.busy:
        return None
    return ring


def _drain(sent: deque[Any]) -> Plan[None]:
    """Wait for every request still out, ignoring their errors (the first one is being raised)."""
    while sent:
        with contextlib.suppress(CuctxError):
            yield Wait(sent.popleft())


def _slot_chunks(pieces: Iterable[tuple[int, memoryview]]) -> Iterator[tuple[int, int, list[tuple[int, memoryview]]]]:
    """Pack pieces (device offset, bytes; ascending, not overlapping) into slot-sized chunks
    ``(device offset, size, [(place in the slot, bytes)])``; pieces less than :data:`GAP_BYTES` apart share
    a chunk, so many small ones cost one request; a piece longer than a slot spans chunks."""
    start, end = 0, 0
    placed: list[tuple[int, memoryview]] = []
    for offset, data in pieces:
        done = 0
        while done < data.nbytes:
            at = offset + done
            if placed and (at - end > GAP_BYTES or at >= start + RING_SLOT_BYTES):
                yield start, end - start, placed
                placed = []
            if not placed:
                start = at
            size = min(data.nbytes - done, start + RING_SLOT_BYTES - at)
            placed.append((at - start, data[done:done + size]))
            end, done = at + size, done + size
    if placed:
        yield start, end - start, placed


def _split_tail(chunks: Iterable[tuple[int, int, list[tuple[int, memoryview]]]]
                ) -> Iterator[tuple[int, int, list[tuple[int, memoryview]]]]:
    """The same chunks, with the last one's final :data:`EDGE_BYTES` made a chunk of its own when it is
    more than twice that (so that the DMA left when the copying ends is a short one)."""
    last = None
    for chunk in chunks:
        if last is not None:
            yield last
        last = chunk
    if last is None:
        return
    start, size, placed = last
    if size <= 2 * EDGE_BYTES:
        yield last
        return
    cut = size - EDGE_BYTES
    head: list[tuple[int, memoryview]] = []
    tail: list[tuple[int, memoryview]] = []
    for place, data in placed:
        if place + data.nbytes <= cut:
            head.append((place, data))
        elif place >= cut:
            tail.append((place - cut, data))
        else:
            head.append((place, data[:cut - place]))
            tail.append((0, data[cut - place:]))
    head_end = head[-1][0] + head[-1][1].nbytes
    skip = tail[0][0]
    yield start, head_end, head
    yield start + cut + skip, size - cut - skip, [(place - skip, data) for place, data in tail]


def _ring_write(ring: StagingRing, buffer: OnDevice, pieces: Iterable[tuple[int, memoryview]]) -> Plan[int]:
    sent: deque[Any] = deque()
    written = 0
    with ring.in_use():
        try:
            for index, (offset, size, placed) in enumerate(_split_tail(_slot_chunks(pieces))):
                if len(sent) == RING_SLOTS:
                    yield Wait(sent.popleft())
                yield Local(partial(ring.copy_in, index, placed))
                sent.append((yield Send(build.memcpy_htod(buffer, ring.host, offset, ring.offset(index), size,
                                                             None))))
                written += sum(data.nbytes for _, data in placed)
            while sent:
                yield Wait(sent.popleft())
        except BaseException:
            yield from _drain(sent)
            raise
    return written


def _ring_write_one(ring: StagingRing, buffer: OnDevice, offset: int, view: memoryview) -> Plan[int]:
    """A write of one chunk (64 KiB - 8 MiB, without the chunking's steps): its request sent early on the
    shm lane, so that its trip and checks overlap the copy (from :data:`EARLY_MIN_BYTES`); else the copy,
    then the request."""
    request = build.memcpy_htod(buffer, ring.host, offset, 0, view.nbytes, None)
    copy = Local(partial(ring.copy_in, 0, [(0, view)]))
    with ring.in_use():
        early = (yield Send(request, early=True)) if view.nbytes >= EARLY_MIN_BYTES else None
        if early is None:
            yield copy
            written: int = yield request
            return written
        try:
            yield copy
        finally:  # the daemon copies, and answers, only after this ring
            yield Local(partial(early.transport.source_ready, early))
        written = yield Wait(early)
    return written


def _ring_read_into(ring: StagingRing, buffer: OnDevice, out: memoryview, offset: int) -> Plan[int]:
    if out.nbytes <= 2 * EDGE_BYTES:  # one chunk: one request, then the copy out
        with ring.in_use():
            yield build.memcpy_dtoh(buffer, ring.host, offset, 0, out.nbytes, None)
            yield Local(partial(ring.copy_out, 0, out))
        return out.nbytes
    starts = [0, *range(EDGE_BYTES, out.nbytes, RING_SLOT_BYTES)]  # a short first DMA, that nothing overlaps
    ends = [*starts[1:], out.nbytes]
    chunks = [(index, at, end - at) for index, (at, end) in enumerate(zip(starts, ends, strict=True))]
    sent: deque[Any] = deque()

    def send(index: int, at: int, size: int) -> Plan[None]:
        call = yield Send(build.memcpy_dtoh(buffer, ring.host, offset + at, ring.offset(index), size, None))
        sent.append((call, index, at, size))

    with ring.in_use():
        try:
            waiting = iter(chunks)
            for chunk in itertools.islice(waiting, RING_SLOTS):
                yield from send(*chunk)
            while sent:
                call, index, at, size = sent.popleft()
                yield Wait(call)
                yield Local(partial(ring.copy_out, index, out[at:at + size]))
                following = next(waiting, None)
                if following is not None:
                    yield from send(*following)
        except BaseException:
            yield from _drain(deque(call for call, *_ in sent))
            raise
    return out.nbytes


def write(owner: Owner, buffer: OnDevice, data: Any, offset: int, stream: OnDevice | None) -> Plan[int]:
    """Host to device by the cheapest path (module docstring)."""
    if isinstance(data, HostBufferFields):
        _check_device(buffer, data)
        written: int = yield build.memcpy_htod(buffer, data, offset, 0, None, stream)
        return written
    view = memoryview(data).cast("B")
    if stream is None and view.nbytes >= RING_MIN_BYTES:
        ring = yield from _ring(owner, buffer.device)
        if ring is not None:
            if view.nbytes <= 2 * EDGE_BYTES:  # one chunk, not split: one request
                return (yield from _ring_write_one(ring, buffer, offset, view))
            return (yield from _ring_write(ring, buffer, [(offset, view)]))
    return (yield from build.write(buffer, view, offset, stream, owner.limits["max_payload_bytes"]))


def write_pieces(owner: Owner, buffer: OnDevice, pieces: Sequence[tuple[int, Any]]) -> Plan[int]:
    """Many host byte ranges into ``buffer`` at their offsets (ascending, not overlapping; a layout's
    tensors): through the ring, pieces close together share one DMA, and **the bytes between them (gaps
    under** :data:`GAP_BYTES` **) are overwritten** with whatever the slot held. Without a ring, one
    payload frame per piece. Returns the bytes of the pieces."""
    views = [(offset, memoryview(data).cast("B")) for offset, data in pieces]
    if sum(view.nbytes for _, view in views) >= RING_MIN_BYTES:
        ring = yield from _ring(owner, buffer.device)
        if ring is not None:
            return (yield from _ring_write(ring, buffer, views))
    written = 0
    for offset, view in views:  # the ring was asked for above: the socket it is
        written += yield from build.write(buffer, view, offset, None, owner.limits["max_payload_bytes"])
    return written


def read_into(owner: Owner, buffer: OnDevice, out: Any, offset: int, stream: OnDevice | None) -> Plan[int]:
    """Device to host straight into ``out`` by the cheapest path (module docstring)."""
    if isinstance(out, HostBufferFields):
        _check_device(buffer, out)
        read: int = yield build.memcpy_dtoh(buffer, out, offset, 0, None, stream)
        return read
    view = memoryview(out).cast("B")
    if stream is None and view.nbytes >= RING_MIN_BYTES:
        ring = yield from _ring(owner, buffer.device)
        if ring is not None:
            return (yield from _ring_read_into(ring, buffer, view, offset))
    step = build.read_into(buffer, view, offset, stream)
    if isinstance(step, Request):
        received: int = yield step
        return received
    return (yield from step)


def read(owner: Owner, buffer: Sized, size: int | None, offset: int, stream: OnDevice | None) -> Plan[bytes]:
    """Device to host as new bytes; large reads land through the ring."""
    size = buffer.size - offset if size is None else size
    if stream is None and RING_MIN_BYTES <= size <= buffer.size - offset:  # out of range: the daemon says why
        ring = yield from _ring(owner, buffer.device)
        if ring is not None:
            out = bytearray(size)
            yield from _ring_read_into(ring, buffer, memoryview(out), offset)
            return bytes(out)
    return (yield from build.read(buffer, size, offset, stream))
