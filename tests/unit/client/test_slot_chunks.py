"""How the staging ring packs a scatter write: pieces close together share a DMA, far ones do not,
and nothing is split except at a slot's end and before a long write's last EDGE_BYTES."""

from __future__ import annotations

from cuctxd.client.data_plane.transfers import EDGE_BYTES, GAP_BYTES, RING_SLOT_BYTES, _slot_chunks, _split_tail


def _pieces(*spans: tuple[int, int]) -> list[tuple[int, memoryview]]:
    return [(offset, memoryview(bytes(size))) for offset, size in spans]


def _shape(chunks: list[tuple[int, int, list[tuple[int, memoryview]]]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    return [(offset, size, [(place, data.nbytes) for place, data in placed]) for offset, size, placed in chunks]


def test_small_pieces_with_alignment_gaps_share_one_chunk() -> None:
    chunks = list(_slot_chunks(_pieces((0, 100), (256, 4), (512, 1000))))
    assert _shape(chunks) == [(0, 1512, [(0, 100), (256, 4), (512, 1000)])]


def test_a_gap_wider_than_the_limit_starts_a_new_chunk() -> None:
    far = 100 + GAP_BYTES + 1
    chunks = list(_slot_chunks(_pieces((0, 100), (far, 10))))
    assert _shape(chunks) == [(0, 100, [(0, 100)]), (far, 10, [(0, 10)])]


def test_a_piece_longer_than_a_slot_spans_chunks_and_the_next_piece_follows_on() -> None:
    big = RING_SLOT_BYTES + 1000
    chunks = list(_slot_chunks(_pieces((0, big), (big + 24, 8))))
    assert _shape(chunks) == [(0, RING_SLOT_BYTES, [(0, RING_SLOT_BYTES)]),
                              (RING_SLOT_BYTES, 1032, [(0, 1000), (1024, 8)])]


def test_no_chunk_outgrows_a_slot() -> None:
    spans = [(i * 3 << 20, 3 << 20) for i in range(20)]
    chunks = list(_slot_chunks(_pieces(*spans)))
    assert all(size <= RING_SLOT_BYTES for _, size, _ in chunks)
    assert sum(data.nbytes for _, _, placed in chunks for _, data in placed) == 60 << 20
    assert [offset for offset, _, _ in chunks] == sorted(offset for offset, _, _ in chunks)


def test_a_long_writes_last_chunk_leaves_a_short_final_dma() -> None:
    chunks = list(_split_tail(_slot_chunks(_pieces((0, 64 << 20)))))
    assert [size for _, size, _ in chunks] == [16 << 20] * 3 + [(16 << 20) - EDGE_BYTES, EDGE_BYTES]
    assert [offset for offset, _, _ in chunks] == [0, 16 << 20, 32 << 20, 48 << 20, (64 << 20) - EDGE_BYTES]


def test_the_tail_split_cuts_a_piece_in_two_and_keeps_every_byte_in_place() -> None:
    data = bytes(range(256)) * ((3 * EDGE_BYTES) // 256)
    pieces = [(0, memoryview(data[:100])), (256, memoryview(data[256:]))]
    chunks = list(_split_tail(_slot_chunks(pieces)))
    assert len(chunks) == 2
    rebuilt = bytearray(len(data))
    for start, size, placed in chunks:
        assert all(place + piece.nbytes <= size for place, piece in placed)
        for place, piece in placed:
            rebuilt[start + place:start + place + piece.nbytes] = piece
    assert rebuilt[:100] == data[:100] and rebuilt[256:] == data[256:]
    assert chunks[1][1] == EDGE_BYTES


def test_short_transfers_are_left_whole() -> None:
    assert _shape(list(_split_tail(_slot_chunks(_pieces((0, 2 * EDGE_BYTES)))))) == [
        (0, 2 * EDGE_BYTES, [(0, 2 * EDGE_BYTES)])]
    assert list(_split_tail(iter([]))) == []
