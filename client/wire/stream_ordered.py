"""Stream-ordered allocation without round trips: ``alloc_async``/``free_async`` (``cuMemAllocAsync``-like).

The client picks the new buffer's handle itself (above the daemon's handles,
``protos.limits.MIN_CLIENT_HANDLE``), so the buffer is usable at once, and keeps
the allocation, like each ``free_async``, in an :class:`Outbox`. The outbox goes
out as ``stream_ordered`` requests, in call order, just before the client's next
request of any kind (or when it holds ``MAX_STREAM_ORDERED_ENTRIES``), and the
client does not wait for their replies: an entry that failed is reported by the
daemon on the next request that names its handle, or by the session's next
synchronize on that device, as CUDA reports asynchronous errors.
Which thread may call: the client's callers, under the client's serialisation.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

from cuctxd.client.wire import build
from cuctxd.client.wire.build import Request
from cuctxd.protos.limits import MAX_STREAM_ORDERED_ENTRIES, MIN_CLIENT_HANDLE, STREAM_ORDERED_ENTRY
from cuctxd.protos.records import BufferRecord

_ENTRY = struct.Struct(STREAM_ORDERED_ENTRY)
_ALLOC, _FREE = 1, 2


class Outbox:
    """Entries not sent yet, as runs of one device and stream, in call order."""

    def __init__(self) -> None:
        self._handles = itertools.count(MIN_CLIENT_HANDLE)
        self._runs: list[tuple[int, int | None, bytearray]] = []
        self.entries = 0

    def __bool__(self) -> bool:
        return self.entries > 0

    def _run_for(self, device: int, stream: int | None) -> bytearray:
        if not self._runs or self._runs[-1][:2] != (device, stream):
            self._runs.append((device, stream, bytearray()))
        return self._runs[-1][2]

    def alloc(self, device: int, size: int, stream: int | None) -> BufferRecord:
        """Queue an allocation; the record of the buffer it will make (context unknown yet: 0)."""
        handle = next(self._handles)
        self._run_for(device, stream).extend(_ENTRY.pack(_ALLOC, handle, size))
        self.entries += 1
        return BufferRecord(handle=handle, device=device, size=size, context=0, shareable=False)

    def free(self, device: int, handle: int, stream: int | None) -> None:
        self._run_for(device, stream).extend(_ENTRY.pack(_FREE, handle, 0))
        self.entries += 1

    def full(self) -> bool:
        return self.entries >= MAX_STREAM_ORDERED_ENTRIES

    def take(self) -> list[Request[Any]]:
        """The queued entries as requests (each within MAX_STREAM_ORDERED_ENTRIES), emptying the outbox."""
        taken = []
        step = MAX_STREAM_ORDERED_ENTRIES * _ENTRY.size
        for device, stream, run in self._runs:
            for at in range(0, len(run), step):
                taken.append(build.stream_ordered(device, stream, bytes(run[at:at + step])))
        self._runs.clear()
        self.entries = 0
        return taken
