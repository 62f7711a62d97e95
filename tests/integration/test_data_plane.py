"""The data plane through a real daemon: shareable buffers (VMM allocations, or pools of their own on a device
without VMM), host buffers, the staging ring, stream-ordered allocation; over real sockets, with real client
processes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cuctxd.client import Client, CudaError, LimitExceeded, NotShareable, UnknownHandle
from cuctxd.client.data_plane.pool_imports import POOL_IMPORTS
from cuctxd.client.data_plane.transfers import EDGE_BYTES, RING_MIN_BYTES, RING_SLOT_BYTES, RING_SLOTS, StagingRing
from cuctxd.client.wire.shm_lane import ShmTransport
from tests.helpers import (
    DaemonProcess,
    pattern,
    run_client,
    running_daemon,
    spawn_client,
    start_daemon,
    tcp_endpoint,
    wait_for_line,
    wait_until,
)


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "256MiB", "--lease-ttl", "2", "--host-memory-per-session", "64MiB",
            "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")


def session_on(c: Client, device: int, session_id: int) -> dict[str, object]:
    return next(s for s in c.status()["devices"][device]["sessions"] if s["session"] == session_id)


@pytest.fixture(scope="module")
def no_vmm_daemon() -> Iterator[DaemonProcess]:
    """A sim daemon whose devices have no VMM: shareable buffers get IPC pools of their own."""
    with running_daemon("--sim-devices", "1", "--sim-memory", "64MiB", "--no-sim-vmm") as process:
        yield process


# --- shareable buffers: VMM allocations, or each in a pool of its own without VMM ---------------------------


def test_a_small_shareable_allocation_is_a_vmm_allocation_whose_fd_is_made_at_each_open(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner:
        buf = owner.alloc(8192, shareable=True)
        buf.write(pattern(8192))
        descriptor = owner.publish(buf, "vmm-shared")
        assert descriptor.mechanism == "vmm" and descriptor.allocation_size == 2 << 20 and not descriptor.pool_id
        consumer = """
from cuctxd.client import Client
with Client(ENDPOINT) as c, c.open_shared("vmm-shared") as s:
    print(bytes(s.host_view()[:16]).hex(), s.size)
    s.host_view()[:4] = b"back"
"""
        assert run_client(consumer, daemon.endpoint).split() == [pattern(8192)[:16].hex(), "8192"]
        assert buf.read(4) == b"back"
        again = run_client(consumer, daemon.endpoint).split()  # a new process, a new fd of the same allocation
        assert again == [(b"back" + pattern(8192)[4:16]).hex(), "8192"]
        owner.unpublish("vmm-shared")


def test_without_vmm_a_shareable_allocation_is_shared_through_its_own_pool(no_vmm_daemon: DaemonProcess) -> None:
    daemon = no_vmm_daemon
    with Client(daemon.endpoint) as owner:
        assert not owner.alloc(8192).shareable
        buf = owner.alloc(8192, shareable=True)
        assert buf.shareable
        buf.write(pattern(8192))
        descriptor = owner.publish(buf, "pool-shared")
        assert descriptor.mechanism == "pool" and len(descriptor.export_data) == 64 and descriptor.pool_id
        assert descriptor.ipc_handle == b""
        consumer = """
from cuctxd.client import Client
with Client(ENDPOINT) as c, c.open_shared("pool-shared") as s:
    print(bytes(s.host_view()[:16]).hex(), s.size)
    s.host_view()[:4] = b"back"
"""
        out = run_client(consumer, daemon.endpoint).split()
        assert out == [pattern(8192)[:16].hex(), "8192"]
        assert buf.read(4) == b"back"
        owner.unpublish("pool-shared")


def test_without_vmm_each_shared_buffer_has_a_pool_of_its_own_imported_once_per_process(
        no_vmm_daemon: DaemonProcess) -> None:
    daemon = no_vmm_daemon
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as consumer:
        first, second = owner.alloc(4096, shareable=True), owner.alloc(4096, shareable=True)
        first.write(b"a" * 4096)
        second.write(b"b" * 4096)
        d1, d2 = owner.export(first), owner.export(second)
        assert d1.pool_id != d2.pool_id
        with consumer.open_shared(d1) as s1:
            assert POOL_IMPORTS.has(d1.pool_id) and not POOL_IMPORTS.has(d2.pool_id)
            tickets_before = consumer.status()
            with consumer.open_shared(d1) as again, consumer.open_shared(d2) as s2:
                assert bytes(s1.host_view()[:1]) == b"a" and bytes(again.host_view()[:1]) == b"a"
                assert bytes(s2.host_view()[:1]) == b"b"
            assert consumer.status()["fd_channel"]["tickets"] == tickets_before["fd_channel"]["tickets"]


def test_shareable_true_still_works_and_means_exportable(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(4096, shareable=True)
        assert buf.shareable and c.export(buf).mechanism == "vmm"


def test_a_tcp_client_on_this_host_maps_vmm_shares_through_the_fd_channel(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner:
        buf = owner.alloc(4096, shareable=True)
        buf.write(b"over tcp")
        descriptor = owner.export(buf)
        with Client(tcp_endpoint(daemon)) as remote, remote.open_shared(descriptor) as share:
            assert bytes(share.host_view()[:8]) == b"over tcp"


def test_without_an_fd_channel_vmm_shares_say_why_and_bytes_take_the_socket() -> None:
    process = start_daemon("--sim-devices", "1", "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp",
                           ipc=False)
    try:
        with Client(tcp_endpoint(process)) as c:
            descriptor = c.export(c.alloc(4096, shareable=True))
            with pytest.raises(NotShareable, match="fd channel"):
                c.open_shared(descriptor)
            with pytest.raises(NotShareable, match="fd channel"):
                c.host_alloc(4096)
            buf = c.alloc(1 << 20)
            buf.write(pattern(1 << 20))
            assert buf.read() == pattern(1 << 20)
            assert session_on(c, 0, c.session_id)["host_bytes"] == 0
    finally:
        assert process.stop() == 0, process.log()


# --- host buffers ---------------------------------------------------------------------------------


def test_host_buffer_is_shared_memory_numpy_can_view_without_a_copy(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        host = c.host_alloc(1 << 20)
        array = np.asarray(host)
        assert array.shape == (1 << 20,) and array.dtype == np.uint8
        array[:5] = np.frombuffer(b"numpy", dtype=np.uint8)
        assert bytes(memoryview(host)[:5]) == b"numpy"  # one memory: no copy in between
        del array
        buf = c.alloc(1 << 20)
        memoryview(host)[:] = pattern(1 << 20)
        assert c.write(buf, host) == 1 << 20
        assert buf.read() == pattern(1 << 20)
        buf.fill(7)
        assert c.read_into(buf, host) == 1 << 20
        assert bytes(memoryview(host)[:3]) == b"\x07\x07\x07"
        host.free()
        host.free()  # nothing the second time


def test_stream_ordered_copies_with_a_host_buffer(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        host = c.host_alloc(64 << 10)
        buf = c.alloc(64 << 10)
        stream = c.create_stream()
        memoryview(host)[:] = pattern(64 << 10, seed=3)
        buf.write(host, stream=stream)
        buf.fill(0, offset=0, size=16, stream=stream)
        buf.read_into(host, stream=stream)
        stream.synchronize()
        assert bytes(memoryview(host)) == b"\0" * 16 + pattern(64 << 10, seed=3)[16:]
        host.free()


def test_host_buffers_count_against_the_session_limit(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        first = c.host_alloc(48 << 20)
        with pytest.raises(LimitExceeded, match="host_memory_per_session"):
            c.host_alloc(32 << 20)
        assert session_on(c, 0, c.session_id)["host_bytes"] == 48 << 20
        first.free()
        c.host_alloc(32 << 20).free()
        assert session_on(c, 0, c.session_id)["host_bytes"] == 0


def test_a_host_buffer_freed_without_waiting_is_gone_before_the_next_request_runs(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        first = c.host_alloc(48 << 20)
        first.free(wait=False)
        first.free(wait=False)  # nothing the second time
        second = c.host_alloc(32 << 20)  # within host_memory_per_session only once the first is freed
        assert session_on(c, 0, c.session_id)["host_bytes"] == 32 << 20
        second.free()
        assert c.ping() > 0  # the unanswered free's reply was read and dropped on the way


def test_a_host_buffer_with_live_views_is_not_freed_under_them(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        host = c.host_alloc(4096)
        view = memoryview(host)
        with pytest.raises(BufferError, match="release them"):
            host.free()
        view.release()
        host.free()


def test_a_host_buffer_serves_only_its_own_device(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        host = c.host_alloc(4096, device=1)
        buf = c.alloc(4096, device=0)
        with pytest.raises(Exception, match="device 1"):
            c.write(buf, host)
        host.free()


HOLDER = """
from cuctxd.client import Client
c = Client(ENDPOINT, heartbeat=False)
host = c.host_alloc(8 << 20)
memoryview(host)[:4] = b"held"
buf = c.alloc(1 << 20)
print("holding", c.session_id, flush=True)
import time
time.sleep(60)
"""


def test_a_killed_clients_host_buffers_are_reclaimed_within_the_lease(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer, spawn_client(HOLDER, daemon.endpoint) as holder:
        session = int(wait_for_line(holder, "holding").split()[1])
        assert session_on(observer, 0, session)["host_bytes"] == 8 << 20
        holder.send_signal(signal.SIGKILL)
        holder.wait()

        def gone() -> bool:
            return all(s["session"] != session for s in observer.status()["devices"][0]["sessions"])

        assert wait_until(gone, timeout=10)
        assert observer.status()["devices"][0]["host_bytes"] == 0


# --- the staging ring -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [RING_MIN_BYTES, 1 << 20, RING_SLOTS * RING_SLOT_BYTES + 12345,
                                  2 * RING_SLOT_BYTES + 3 * EDGE_BYTES + 7])  # the last: its tail is split
def test_large_transfers_go_through_the_staging_ring_and_arrive_whole(daemon: DaemonProcess, size: int) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(size)
        data = pattern(size, seed=size)
        assert buf.write(data) == size
        assert session_on(c, 0, c.session_id)["host_bytes"] == RING_SLOTS * RING_SLOT_BYTES
        out = bytearray(size)
        assert buf.read_into(out) == size
        assert out == data
        assert buf.read(size - 1, offset=1) == data[1:]


def test_ring_transfers_keep_range_errors(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(1 << 20)
        with pytest.raises(Exception, match="outside"):
            buf.write(bytes(2 << 20))
        assert buf.write(b"x" * (1 << 20)) == 1 << 20  # the ring is usable after the error


def test_a_one_chunk_write_sends_its_request_before_its_copy(daemon: DaemonProcess,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rung: list[str] = []
    source_ready = ShmTransport.source_ready

    def spy(lane: ShmTransport, call: Any) -> None:
        rung.append(call.op)
        source_ready(lane, call)

    monkeypatch.setattr(ShmTransport, "source_ready", spy)
    with Client(daemon.endpoint) as c:
        buf = c.alloc(1 << 20)
        data = pattern(1 << 20, seed=1)
        buf.write(data)
        assert rung == ["memcpy_htod"]
        assert buf.read() == data
        buf.write(data[:RING_MIN_BYTES - 1])  # a payload frame: nothing to send early
        assert rung == ["memcpy_htod"]


def test_an_interrupted_copy_still_rings_and_the_lane_goes_on(daemon: DaemonProcess,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(daemon.endpoint, timeout=5) as c:  # a reply held for a ring never sent: DaemonTimeout
        buf = c.alloc(1 << 20)
        buf.write(bytes(1 << 20))

        def interrupted(ring: StagingRing, index: int, pieces: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(StagingRing, "copy_in", interrupted)
        with pytest.raises(KeyboardInterrupt):
            buf.write(pattern(1 << 20))
        monkeypatch.undo()
        data = pattern(1 << 20, seed=2)
        buf.write(data)
        assert buf.read() == data
        assert c.shm_lanes == (0,)


def test_without_room_for_a_ring_transfers_take_the_socket(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        hog = c.host_alloc(60 << 20)  # the ring (32 MiB) no longer fits in 64 MiB
        buf = c.alloc(2 << 20)
        buf.write(pattern(2 << 20))
        assert buf.read() == pattern(2 << 20)
        assert session_on(c, 0, c.session_id)["host_bytes"] == 60 << 20
        hog.free()


# --- stream-ordered allocation ----------------------------------------------------------------------


def test_alloc_async_buffers_are_usable_at_once(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buffers = [c.alloc_async(4096) for _ in range(100)]
        buffers[7].write(b"seven")
        assert buffers[7].read(5) == b"seven"
        for buf in buffers:
            c.free_async(buf)
        c.synchronize()
        assert session_on(c, 0, c.session_id)["allocations"] == 0


def test_a_failed_alloc_async_is_reported_by_its_next_use_and_by_synchronize(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        huge = c.alloc_async(1 << 40)
        with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            c.synchronize()
        c.synchronize()  # reported once
        with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            huge.write(b"x")
        with pytest.raises(UnknownHandle):
            huge.write(b"x")


IMPORTER = """
from cuctxd.client import Client
c = Client(ENDPOINT, heartbeat=False)
share = c.open_shared("held-by-a-goner")
print("mapped", c.session_id, bytes(share.host_view()[:4]).decode(), flush=True)
import time
time.sleep(60)
"""


def test_an_importers_kill_frees_the_owners_memory_only_when_it_is_reaped(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner:
        buf = owner.alloc(1 << 20, shareable=True)
        buf.write(b"kept" + bytes((1 << 20) - 4))
        owner.publish(buf, "held-by-a-goner")
        with spawn_client(IMPORTER, daemon.endpoint) as importer:
            line = wait_for_line(importer, "mapped")
            assert line.split()[2] == "kept"
            owner.free(buf)  # the owner lets go first: the share lives on for its holder
            shares = owner.status()["devices"][0]["shares"]
            assert [s["holders"] for s in shares if s["size"] == 1 << 20] == [[int(line.split()[1])]]
            importer.send_signal(signal.SIGKILL)
            importer.wait()

            def freed() -> bool:
                return all(s["size"] != 1 << 20 for s in owner.status()["devices"][0]["shares"])

            assert not freed()
            assert wait_until(freed, timeout=10), "the killed importer's hold outlived its lease"
