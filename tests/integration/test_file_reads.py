"""File ranges loaded into a daemon buffer by reader threads, hashed on the way (client/data_plane/file_reads.py),
against a real sim daemon: from the page cache, with O_DIRECT once the file is evicted, and as plain writes
where the session may not have host buffers."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuctxd import Client
from cuctxd.client.api.objects import Buffer
from cuctxd.client.data_plane import file_reads
from cuctxd.client.data_plane.file_reads import FileRange, load_file_ranges, load_into_new_buffer
from cuctxd.client.wire import build
from cuctxd.protos.digests import tensor_digest
from cuctxd.protos.errors import CudaError
from tests.helpers import DaemonProcess, running_daemon

MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "256MiB")


#: Tensor sizes: small ones together, one longer than a slot, one not a multiple of a block.
SIZES = [4096, 100, 0, 3 * MIB + 7, 20 * MIB + 12345, 256, 5 * MIB]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[tuple[int, list[FileRange], bytes]]:
    """A file of random tensors after a 24-byte header, and the ranges a layout would load (256-byte padding)."""
    data = os.urandom(sum(SIZES))
    path = tmp_path / "weights.bin"
    path.write_bytes(b"h" * 24 + data)
    fd = os.open(path, os.O_RDONLY)
    ranges, file_at, device_at = [], 24, 0
    for size in SIZES:
        ranges.append(FileRange(fd, file_at, size, device_at))
        file_at += size
        device_at += -(-max(size, 1) // 256) * 256
    try:
        yield fd, ranges, b"h" * 24 + data
    finally:
        os.close(fd)


def _check(client: Client, buffer: object, ranges: list[FileRange], content: bytes, found: list[str | None]) -> None:
    held = client.read(buffer)  # type: ignore[arg-type]
    for item, digest in zip(ranges, found, strict=True):
        expected = content[item.offset:item.offset + item.nbytes]
        assert held[item.device_offset:item.device_offset + item.nbytes] == expected
        assert digest == tensor_digest(expected)


@pytest.mark.parametrize("readers", [1, 2, 8])
def test_ranges_from_the_page_cache_land_at_their_offsets_with_their_digests(
        daemon: DaemonProcess, checkpoint: tuple[int, list[FileRange], bytes], readers: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More chunks than slots: every slot waits for its DMA's answer before the next chunk takes it."""
    monkeypatch.setattr(file_reads, "MAX_READERS", readers)
    _, ranges, content = checkpoint
    reported: list[tuple[int, int]] = []
    with Client(daemon.endpoint) as c:
        buffer = c.alloc(ranges[-1].device_offset + ranges[-1].nbytes)
        found = load_file_ranges(c, buffer, ranges, progress=lambda done, total: reported.append((done, total)))
        _check(c, buffer, ranges, content, found)
        assert reported[-1] == (sum(SIZES), sum(SIZES))
        assert [done for done, _ in reported] == sorted(done for done, _ in reported)


def test_an_evicted_file_is_read_with_o_direct(daemon: DaemonProcess,
                                                checkpoint: tuple[int, list[FileRange], bytes],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fd, ranges, content = checkpoint
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    planned: list[bool] = []
    plan = file_reads._Reader.plan_direct

    def recording(self: file_reads._Reader, chunk: file_reads.Chunk) -> bool:
        planned.append(plan(self, chunk))
        return planned[-1]

    monkeypatch.setattr(file_reads._Reader, "plan_direct", recording)
    with Client(daemon.endpoint) as c:
        buffer = c.alloc(ranges[-1].device_offset + ranges[-1].nbytes)
        _check(c, buffer, ranges, content, load_file_ranges(c, buffer, ranges))
    assert any(planned), "no chunk was read with O_DIRECT"


def test_without_room_for_host_buffers_the_ranges_go_as_writes(
        checkpoint: tuple[int, list[FileRange], bytes]) -> None:
    _, ranges, content = checkpoint
    with running_daemon("--sim-devices", "1", "--sim-memory", "64MiB", "--host-memory-per-session", "1MiB") as daemon, \
            Client(daemon.endpoint) as c:
        buffer = c.alloc(ranges[-1].device_offset + ranges[-1].nbytes)
        found = load_file_ranges(c, buffer, ranges)
        _check(c, buffer, ranges, content, found)
        assert load_file_ranges(c, buffer, ranges, digest=False) == [None] * len(ranges)


def test_a_short_file_raises_and_leaves_no_host_buffer(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Client(daemon.endpoint) as c:
            buffer = c.alloc(4 * MIB)
            with pytest.raises(EOFError, match="ended"):
                load_file_ranges(c, buffer, [FileRange(fd, 0, 2 * MIB, 0)])
            assert c.host_alloc(MIB) is not None  # the load's host buffer went back
    finally:
        os.close(fd)


def test_a_new_buffer_is_made_while_the_first_chunks_are_read(
        daemon: DaemonProcess, checkpoint: tuple[int, list[FileRange], bytes]) -> None:
    _, ranges, content = checkpoint
    size = ranges[-1].device_offset + ranges[-1].nbytes
    with Client(daemon.endpoint) as c:
        with load_into_new_buffer(c, build.alloc(c, Buffer, size, 0, True), 0, ranges) as (buffer, found):
            assert c.status()["devices"][0]["host_bytes"] > 0, "the load ring is held while the block runs"
        assert c.status()["devices"][0]["host_bytes"] == 0, "and given back after it"
        assert buffer.size == size
        _check(c, buffer, ranges, content, found)
        buffer.free()


def test_a_failed_load_into_a_new_buffer_leaves_nothing_allocated(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Client(daemon.endpoint) as c:
            free_before = c.mem_get_info(0)[0]
            with pytest.raises(EOFError), load_into_new_buffer(c, build.alloc(c, Buffer, 4 * MIB, 0, True), 0,
                                                               [FileRange(fd, 0, 2 * MIB, 0)]):
                pytest.fail("the load of a short file went on")
            with pytest.raises(CudaError) as no_room, load_into_new_buffer(c, build.alloc(c, Buffer, 1 << 40, 0, True),
                                                                           0, [FileRange(fd, 0, 1000, 0)]):
                pytest.fail("the load into a buffer without room went on")
            assert no_room.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
            assert c.mem_get_info(0)[0] == free_before
    finally:
        os.close(fd)


def _evicted(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def test_o_direct_reads_go_in_steps_in_file_order(daemon: DaemonProcess,
                                                  checkpoint: tuple[int, list[FileRange], bytes],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One stream for the disk: each ``O_DIRECT`` read at most a step, the steps taken in file order
    across chunks (one reader, so the order taken is the order read)."""
    fd, ranges, content = checkpoint
    _evicted(fd)
    monkeypatch.setattr(file_reads, "MAX_READERS", 1)
    direct_reads: list[tuple[int, int]] = []
    preadv = os.preadv

    def recording(into_fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(into_fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_reads.append((offset, sum(b.nbytes for b in buffers)))
        return preadv(into_fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording)
    with Client(daemon.endpoint) as c:
        buffer = c.alloc(ranges[-1].device_offset + ranges[-1].nbytes)
        _check(c, buffer, ranges, content, load_file_ranges(c, buffer, ranges))
    assert len(direct_reads) > 1, "the evicted file was not read with O_DIRECT"
    assert max(size for _, size in direct_reads) <= file_reads.DIRECT_STEP
    offsets = [offset for offset, _ in direct_reads]
    assert offsets == sorted(offsets)


def test_a_file_cut_short_under_o_direct_steps_raises_and_leaves_nothing(
        daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that finds the end fails the chunk; the steps after it still finish before the ring goes
    back. (``mincore`` sends a range past a file's end to buffered reads; a file cut while it loads reaches
    the steps, which this forces.)"""
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(5 * MIB))
    fd = os.open(path, os.O_RDONLY)
    monkeypatch.setattr(file_reads._Reader, "plan_direct",
                        lambda self, chunk: self.direct_twin(chunk.pieces[0].fd) is not None)
    try:
        _evicted(fd)
        with Client(daemon.endpoint) as c:
            free_before = c.mem_get_info(0)[0]
            with pytest.raises(EOFError, match="ended"), \
                    load_into_new_buffer(c, build.alloc(c, Buffer, 24 * MIB, 0, True), 0,
                                         [FileRange(fd, 0, 24 * MIB, 0)]):
                pytest.fail("the load of a short file went on")
            assert c.mem_get_info(0)[0] == free_before
            assert c.status()["devices"][0]["host_bytes"] == 0
    finally:
        os.close(fd)
