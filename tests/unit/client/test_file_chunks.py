"""How file ranges are packed into slot-sized chunks for a load (client/data_plane/file_reads.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cuctxd.client.data_plane.file_reads import FileRange, plan_chunks
from cuctxd.protos.digests import LEAF_BYTES

SLOT = 4 * LEAF_BYTES


def _layout(sizes: list[int], align: int = 256) -> list[FileRange]:
    """Ranges as a layout places a file's tensors: contiguous in the file, each padded to ``align``."""
    ranges, file_at, device_at = [], 8, 0
    for size in sizes:
        ranges.append(FileRange(3, file_at, size, device_at))
        file_at += size
        device_at += -(-max(size, 1) // align) * align
    return ranges


@given(st.lists(st.integers(0, 3 * SLOT), min_size=1, max_size=30))
def test_every_byte_lands_once_within_a_slot_and_cuts_fall_on_leaves(sizes: list[int]) -> None:
    ranges = _layout(sizes)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(ranges))}
    for chunk in plan_chunks(ranges, slot=SLOT):
        assert 0 < chunk.size <= SLOT or all(p.nbytes == 0 for p in chunk.pieces)
        for piece in chunk.pieces:
            item = ranges[piece.index]
            assert piece.start % LEAF_BYTES == 0  # a range is cut only at a leaf's edge
            assert chunk.device_offset + piece.place == item.device_offset + piece.start
            assert piece.file_offset == item.offset + piece.start
            assert piece.place + piece.nbytes <= chunk.size
            covered[piece.index].append((piece.start, piece.nbytes))
    for index, item in enumerate(ranges):
        spans = sorted(covered[index])
        assert spans, "every range is in some chunk"
        at = 0
        for start, size in spans:
            assert start == at
            at += size
        assert at == item.nbytes


def test_small_ranges_close_together_share_one_chunk() -> None:
    chunks = list(plan_chunks(_layout([4096] * 100), slot=SLOT))
    assert len(chunks) == 1 and len(chunks[0].pieces) == 100


def test_ranges_far_apart_get_chunks_of_their_own() -> None:
    ranges = [FileRange(3, 0, 100, 0), FileRange(3, 100, 100, 1 << 20)]
    assert [len(c.pieces) for c in plan_chunks(ranges, slot=SLOT)] == [1, 1]


def test_a_range_longer_than_a_slot_spans_chunks_of_whole_leaves() -> None:
    chunks = list(plan_chunks([FileRange(3, 8, 2 * SLOT + 5, 0)], slot=SLOT))
    assert [c.size for c in chunks] == [SLOT, SLOT, 5]
