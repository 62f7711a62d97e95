"""File ranges into a daemon buffer, hashed on the way: what ``cuctx load`` moves.

:func:`load_file_ranges` reads each :class:`FileRange` (a tensor's bytes in a checkpoint file) into
the buffer at its offset and returns each range's digest (:mod:`cuctxd.protos.digests`), computed from
the bytes as they pass, never by a second read. Which thread may call: the client's callers (one load
at a time per client).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cuctxd.client.data_plane import transfers
from cuctxd.protos import digests

#: Bytes read and written between two progress reports (and the most held in this process at once).
BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes at ``offset`` of the open file ``fd``, for the buffer at ``device_offset``."""

    fd: int
    offset: int
    nbytes: int
    device_offset: int


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < into.nbytes:
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise EOFError(f"the file ended {into.nbytes - done} bytes early (at byte {offset + done})")
        done += got


def load_file_ranges(client: Any, buffer: Any, ranges: Sequence[FileRange], *, digest: bool = True,
                     progress: Callable[[int, int], None] | None = None) -> list[str | None]:
    """Copy every range into ``buffer`` (ranges ascending by ``device_offset``, not overlapping); returns
    each range's digest (None without ``digest``). ``progress(done, total)`` in bytes. A short file raises
    :class:`EOFError`; what was written stays in the buffer, which the caller frees."""
    total = sum(r.nbytes for r in ranges)
    results: list[str | None] = []
    done = 0
    index = 0
    while index < len(ranges):
        batch: list[FileRange] = []
        size = 0
        while index < len(ranges) and (not batch or size + ranges[index].nbytes <= BATCH_BYTES):
            batch.append(ranges[index])
            size += ranges[index].nbytes
            index += 1
        staging = memoryview(bytearray(size))
        pieces, at = [], 0
        for piece in batch:
            view = staging[at:at + piece.nbytes]
            _read_exactly(piece.fd, view, piece.offset)
            results.append(digests.tensor_digest(view) if digest else None)
            pieces.append((piece.device_offset, view))
            at += piece.nbytes
        done += client.run(transfers.write_pieces(client, buffer, [p for p in pieces if p[1].nbytes]))
        if progress is not None:
            progress(done, total)
    return results


__all__ = ["FileRange", "load_file_ranges"]
