"""Streams, events, non-blocking synchronization and pipelining through a real daemon."""

from __future__ import annotations

import threading
import time

import pytest

from cuctxd.client import Client, CudaError, OutOfRange, UnknownHandle
from tests.helpers import DaemonProcess


@pytest.fixture
def client(routed_client: Client) -> Client:
    """Every test here runs through the device endpoints and through the main endpoint only."""
    return routed_client


MIB = 1 << 20


def test_work_on_one_stream_runs_in_order(client: Client) -> None:
    stream = client.create_stream(0)
    src, dst = client.alloc(MIB, 0), client.alloc(MIB, 0)
    payload = bytes(range(256)) * 4096
    assert src.write(payload, stream=stream) == MIB
    src.copy_to(dst, stream=stream)
    dst.fill(9, offset=0, size=16, stream=stream)
    assert dst.read(32, stream=stream) == b"\x09" * 16 + payload[16:32]
    stream.synchronize()
    assert stream.query() is True
    stream.destroy()
    with pytest.raises(UnknownHandle):
        stream.query()


def test_events_order_two_streams_and_time_work(client: Client) -> None:
    first, second = client.create_stream(0), client.create_stream(0, non_blocking=True)
    start, end = client.create_event(0), client.create_event(0)
    buf = client.alloc(8 * MIB, 0)
    start.record(first)
    buf.fill(5, stream=first)
    end.record(first)
    second.wait_event(end)
    assert buf.read(4, offset=8 * MIB - 4, stream=second) == b"\x05" * 4
    end.synchronize()
    assert end.query() is True
    assert start.elapsed_time(end) >= 0.0
    untimed = client.create_event(0, timing=False)
    untimed.record(first)
    untimed.synchronize()
    with pytest.raises(CudaError) as no_timing:
        start.elapsed_time(untimed)
    assert no_timing.value.name == "CUDA_ERROR_INVALID_HANDLE"
    for obj in (start, end, untimed, first, second):
        obj.destroy()


def test_synchronize_replies_and_the_legacy_stream_sees_stream_work(client: Client) -> None:
    stream = client.create_stream(0)
    buf = client.alloc(4 * MIB, 0)
    buf.fill(1, stream=stream)
    client.synchronize(0)
    assert buf.read(2, offset=4 * MIB - 2) == b"\x01\x01"
    client.device_synchronize(0)


def test_shareable_memory_is_its_own_vmm_allocation(client: Client) -> None:
    assert not client.alloc(4096, 0).shareable
    shared = client.alloc(4096, 0, shareable=True)
    assert shared.shareable and shared.export().mechanism == "vmm" and shared.export().size == 4096


def test_pipelined_writes_land_in_order(client: Client) -> None:
    buf = client.alloc(64 * 1000, 0)
    with client.pipeline() as p:
        calls = [p.write(buf, bytes([i % 256]) * 64, offset=i * 64) for i in range(1000)]
        last = p.read(buf, 64, offset=999 * 64)
    assert all(call.result() == 64 for call in calls)
    assert last.result() == bytes([999 % 256]) * 64
    data = buf.read()
    assert all(data[i * 64] == i % 256 for i in range(1000))


def test_pipeline_reports_the_first_error_after_all_replies(client: Client) -> None:
    buf = client.alloc(128, 0)
    with pytest.raises(OutOfRange), client.pipeline() as p:
        p.write(buf, b"x" * 64, offset=0)
        p.write(buf, b"y" * 64, offset=1000)
    assert buf.read(1) == b"x"


def test_large_writes_and_reads_are_chunked_transparently(client: Client) -> None:
    size = 12 * MIB + 123
    buf = client.alloc(size, 1)
    payload = bytes(range(251)) * (size // 251) + bytes(size % 251)
    assert buf.write(payload) == size
    out = bytearray(size)
    assert buf.read_into(out) == size
    assert out == payload


def test_a_long_synchronize_does_not_block_its_device(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as busy, Client(daemon.endpoint) as other:
        stream = busy.create_stream(0, non_blocking=True)  # the legacy stream must not wait for it
        big = busy.alloc(48 * MIB, 0)
        with busy.pipeline() as p:
            for _ in range(6):
                p.fill(big, 3, stream=stream)
        waited = threading.Event()

        def wait_for_stream() -> None:
            stream.synchronize()
            waited.set()

        thread = threading.Thread(target=wait_for_stream)
        thread.start()
        start = time.perf_counter()
        small = other.alloc(64, 0)
        small.write(b"z" * 64)
        assert small.read(64) == b"z" * 64
        assert time.perf_counter() - start < 5.0
        thread.join(30)
        assert waited.is_set()
