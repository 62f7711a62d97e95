"""Every op through the client library against a real daemon, with real bytes."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cuctxd.client import Client, CudaError
from cuctxd.daemon import __version__
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import DaemonProcess, pattern


@pytest.fixture
def client(routed_client: Client) -> Client:
    """Every test here runs through the device endpoints and through the main endpoint only."""
    return routed_client


MiB = 1 << 20
DEVICE_MEMORY = 64 * MiB


def device_status(client: Client, device: int) -> dict[str, Any]:
    return next(d for d in client.status()["devices"] if d["device"] == device)


def counts(entry: dict[str, Any]) -> dict[str, int]:
    """The context and memory counters of a session's entry in a device's status."""
    return {k: entry[k] for k in ("contexts", "stack_depth", "allocations", "bytes")}


def my_entry(client: Client, device: int) -> dict[str, Any] | None:
    entries = [s for s in device_status(client, device)["sessions"] if s["session"] == client.session_id]
    return entries[0] if entries else None


# --- session and daemon ------------------------------------------------------------------


def test_hello_describes_the_daemon(client: Client) -> None:
    assert client.protocol == PROTOCOL_VERSION
    assert client.daemon_version == __version__
    assert client.backend == "sim"
    assert client.session_id >= 1
    assert client.limits["max_payload_bytes"] == 1 << 30
    assert client.limits["max_payload_frames"] == 1


def test_sessions_get_distinct_ids(daemon: DaemonProcess, client: Client) -> None:
    with Client(daemon.endpoint, timeout=10) as other:
        assert other.session_id != client.session_id


def test_ping(client: Client) -> None:
    assert 0 < client.ping() < 5


def test_device_count_and_devices(client: Client) -> None:
    assert client.device_count() == 2
    devices = client.devices()
    assert [d.index for d in devices] == [0, 1]
    for d in devices:
        assert d.total_memory == DEVICE_MEMORY
        assert d.compute_capability == (9, 0)
        assert d.uuid.startswith("GPU-")
        assert d.multiprocessor_count > 0
    assert devices[0].uuid != devices[1].uuid
    assert devices[0].pci_bus_id != devices[1].pci_bus_id


def test_get_device_follows_set_device(client: Client) -> None:
    assert client.get_device() == 0
    client.set_device(1)
    assert client.get_device() == 1
    client.set_device(0)
    assert client.get_device() == 0


def test_goodbye_ends_the_session(daemon: DaemonProcess, client: Client) -> None:
    other = Client(daemon.endpoint, timeout=10)
    other_id = other.session_id
    other.alloc(4096)
    assert other_id in [s["session"] for s in client.status()["sessions"]]
    other.close()
    assert other_id not in [s["session"] for s in client.status()["sessions"]]
    assert all(s["session"] != other_id for d in client.status()["devices"] for s in d["sessions"])


# --- contexts ----------------------------------------------------------------------------


def test_create_push_pop_destroy(client: Client) -> None:
    primary = client.set_device(0)
    created = client.create_context()
    assert not created.is_primary
    assert created.device == 0
    assert created.context_id != primary.context_id
    assert [c.handle for c in client.context_stack()] == [primary.handle, created.handle]
    current = client.current_context()
    assert current is not None and current.handle == created.handle

    popped = client.pop_context()
    assert popped.handle == created.handle
    assert [c.handle for c in client.context_stack()] == [primary.handle]

    created.push()
    created.push()
    assert [c.handle for c in client.context_stack()] == [primary.handle, created.handle, created.handle]

    created.destroy()
    assert [c.handle for c in client.context_stack()] == [primary.handle]
    current = client.current_context()
    assert current is not None and current.handle == primary.handle


def test_pop_to_empty_then_runtime_call_binds_the_primary_again(client: Client) -> None:
    primary = client.set_device(0)
    assert client.pop_context().handle == primary.handle
    assert client.current_context() is None
    client.synchronize()
    current = client.current_context()
    assert current is not None
    assert current.handle == primary.handle


def test_context_info(client: Client) -> None:
    created = client.create_context(device=1, flags=0x04)
    info = created.info()
    assert info.handle == created.handle
    assert info.device == 1
    assert info.flags == 0x04
    assert info.api_version == 3020
    assert not info.is_primary
    primary = client.set_device(1)
    assert primary.info().is_primary


def test_contexts_on_each_device_are_separate_stacks(client: Client) -> None:
    on0 = client.create_context(device=0)
    on1 = client.create_context(device=1)
    assert [c.handle for c in client.context_stack(device=0)] == [on0.handle]
    assert [c.handle for c in client.context_stack(device=1)] == [on1.handle]
    assert client.pop_context(device=1).handle == on1.handle
    assert [c.handle for c in client.context_stack(device=0)] == [on0.handle]


def test_synchronize_binds_the_primary_lazily(client: Client) -> None:
    assert client.current_context(device=1) is None
    client.synchronize(device=1)
    current = client.current_context(device=1)
    assert current is not None and current.is_primary


def test_device_synchronize_waits_for_other_sessions_streams(daemon: DaemonProcess, client: Client) -> None:
    client.create_context(device=0)
    with Client(daemon.endpoint, timeout=10) as other:
        other.create_context(device=0)
        buffer = other.alloc(32 << 20, device=0)
        stream = other.create_stream(0, non_blocking=True)  # a read on the legacy stream will not wait for it
        for value in range(1, 9):
            buffer.fill(value, stream=stream)  # about 8 x 32 MiB of queued work
        client.device_synchronize(device=0)
        assert stream.query() is True, "device_synchronize returned with another session's stream busy"
        assert buffer.read(16, offset=(32 << 20) - 16) == b"\x08" * 16
    client.device_synchronize(device=1)  # nothing alive there: still fine


# --- memory ------------------------------------------------------------------------------


def test_alloc_returns_a_buffer_in_the_current_context(client: Client) -> None:
    created = client.create_context(device=1)
    buffer = client.alloc(1000, device=1)
    assert buffer.size == 1000
    assert buffer.device == 1
    assert buffer.context == created.handle
    primary = client.set_device(0)
    assert client.alloc(10).context == primary.handle


def test_alloc_binds_the_primary_lazily(client: Client) -> None:
    buffer = client.alloc(64)
    current = client.current_context()
    assert current is not None and current.is_primary
    assert buffer.context == current.handle


def test_mem_get_info_decreases_after_alloc_and_recovers_after_free(client: Client) -> None:
    free0, total = client.mem_get_info()
    assert total == DEVICE_MEMORY
    buffer = client.alloc(4 * MiB)
    free1, _ = client.mem_get_info()
    assert free1 == free0 - 4 * MiB
    client.alloc(MiB, device=1)
    assert client.mem_get_info()[0] == free1  # device 1's memory is its own
    buffer.free()
    assert client.mem_get_info()[0] == free0


def test_new_buffers_read_as_zeros(client: Client) -> None:
    assert client.alloc(4096).read() == bytes(4096)


def test_write_and_read_round_trip_with_offsets(client: Client) -> None:
    buffer = client.alloc(10_000)
    data = pattern(10_000)
    assert buffer.write(data) == 10_000
    assert buffer.read() == data
    assert buffer.write(b"XYZ", offset=9_997) == 3
    assert buffer.read(10, offset=9_990) == data[9_990:9_997] + b"XYZ"
    assert buffer.read(0, offset=10_000) == b""
    assert buffer.read(offset=9_999) == b"Z"


def test_empty_write_and_read(client: Client) -> None:
    buffer = client.alloc(16)
    assert buffer.write(b"") == 0
    assert buffer.write(b"", offset=16) == 0
    assert buffer.read(0) == b""
    assert buffer.read() == bytes(16)


def test_large_write_and_read(client: Client) -> None:
    data = os.urandom(8 * MiB)
    buffer = client.alloc(len(data), device=1)
    assert buffer.write(memoryview(data)) == len(data)
    assert buffer.read() == data


def test_write_accepts_any_buffer_object(client: Client) -> None:
    buffer = client.alloc(8)
    buffer.write(bytearray(b"\x01\x02\x03\x04"))
    buffer.write(memoryview(b"\x05\x06\x07\x08"), offset=4)
    assert buffer.read() == bytes(range(1, 9))


def test_read_into_a_host_buffer(client: Client) -> None:
    buffer = client.alloc(4096)
    data = pattern(4096, seed=3)
    buffer.write(data)
    out = bytearray(1000)
    assert buffer.read_into(out, offset=96) == 1000
    assert bytes(out) == data[96:1096]


def test_fill(client: Client) -> None:
    buffer = client.alloc(1000)
    buffer.fill(0x11)
    assert buffer.read() == b"\x11" * 1000
    buffer.fill(0xFF, offset=100, size=50)
    buffer.fill(0x00, offset=990)
    assert buffer.read() == b"\x11" * 100 + b"\xff" * 50 + b"\x11" * 840 + bytes(10)


def test_copy_on_one_device_with_offsets(client: Client) -> None:
    src = client.alloc(4096)
    dst = client.alloc(4096)
    data = pattern(4096, seed=9)
    src.write(data)
    dst.fill(0xEE)
    assert src.copy_to(dst, 1000, src_offset=500, dst_offset=3000) == 1000
    assert dst.read() == b"\xee" * 3000 + data[500:1500] + b"\xee" * 96
    assert src.copy_to(dst) == 4096
    assert dst.read() == data


def test_copy_within_one_buffer_overlapping(client: Client) -> None:
    buffer = client.alloc(100)
    buffer.write(bytes(range(100)))
    assert buffer.copy_to(buffer, 50, src_offset=0, dst_offset=25) == 50
    assert buffer.read() == bytes(range(25)) + bytes(range(50)) + bytes(range(75, 100))


def test_copy_across_devices(client: Client) -> None:
    src = client.alloc(64 * 1024, device=0)
    dst = client.alloc(64 * 1024, device=1)
    data = os.urandom(64 * 1024)
    src.write(data)
    assert src.copy_to(dst, 20_000, src_offset=1_000, dst_offset=40_000) == 20_000
    assert dst.read(20_000, offset=40_000) == data[1_000:21_000]
    assert dst.read(40_000) == bytes(40_000)
    assert dst.copy_to(src, 100, src_offset=40_000) == 100
    assert src.read(100) == data[1_000:1_100]


def test_copy_between_contexts_of_one_device(client: Client) -> None:
    in_primary = client.alloc(256)
    client.create_context()
    in_created = client.alloc(256)
    assert in_primary.context != in_created.context
    in_primary.write(pattern(256))
    in_primary.copy_to(in_created)
    assert in_created.read() == pattern(256)


def test_free_then_the_buffer_is_gone(client: Client) -> None:
    buffer = client.alloc(128)
    buffer.free()
    assert buffer.freed
    buffer.free()  # the client object remembers; no second request
    entry = my_entry(client, 0)
    assert entry is not None
    assert (entry["allocations"], entry["bytes"]) == (0, 0)


def test_buffer_as_context_manager_frees(client: Client) -> None:
    free_before = client.mem_get_info()[0]
    with client.alloc(MiB) as buffer:
        assert client.mem_get_info()[0] == free_before - MiB
        buffer.fill(1)
    assert client.mem_get_info()[0] == free_before


def test_runtime_errors_surface_as_cuda_errors(client: Client) -> None:
    with pytest.raises(CudaError) as info:
        client.alloc(0)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert info.value.code == 1


# --- status ------------------------------------------------------------------------------


def test_status_reports_the_daemon(daemon: DaemonProcess, client: Client) -> None:
    status = client.status()
    assert status["daemon_version"] == __version__
    assert status["protocol"] == PROTOCOL_VERSION
    assert status["backend"] == "sim"
    assert status["pid"] == daemon.process.pid
    assert status["uptime_s"] >= 0
    assert status["endpoints"] == [daemon.endpoint]
    assert [d["device"] for d in status["devices"]] == [0, 1]
    mine = [s for s in status["sessions"] if s["session"] == client.session_id]
    assert len(mine) == 1
    assert mine[0]["pid"] == os.getpid()
    assert mine[0]["current_device"] == 0


def test_status_names_each_devices_worker_thread(client: Client) -> None:
    for device in client.status()["devices"]:
        assert device["worker"]["name"] == f"cuctxd-device-{device['device']}"
        assert device["worker"]["alive"] is True
        assert device["worker"]["native_id"] > 0
        assert device["name"] == "cuctxd simulated GPU"
    ids = {d["worker"]["native_id"] for d in client.status()["devices"]}
    assert len(ids) == 2


def test_status_counts_allocations_and_bytes_per_session_and_device(
    daemon: DaemonProcess, client: Client
) -> None:
    with Client(daemon.endpoint, timeout=10, name="second") as other:
        for size in (1000, 2000, 3000):
            client.alloc(size)
        created = client.create_context(device=0)
        client.alloc(4000)
        other.alloc(5000, device=1)
        other.set_device(1)
        status = client.status()
        sessions = {s["session"]: s for s in status["sessions"]}
        assert sessions[other.session_id]["client"] == "second"
        assert sessions[other.session_id]["current_device"] == 1

        dev0, dev1 = status["devices"]
        mine0 = next(s for s in dev0["sessions"] if s["session"] == client.session_id)
        assert counts(mine0) == {"contexts": 2, "stack_depth": 2, "allocations": 4, "bytes": 10_000}
        assert all(s["session"] != other.session_id for s in dev0["sessions"])
        theirs1 = next(s for s in dev1["sessions"] if s["session"] == other.session_id)
        assert counts(theirs1) == {"contexts": 1, "stack_depth": 1, "allocations": 1, "bytes": 5000}

        assert dev0["primary_context"]["active"] is True
        assert dev0["primary_context"]["references"] == 1
        assert dev1["primary_context"]["active"] is True
        kinds = {c["context_id"]: c for c in dev0["contexts"]}
        assert kinds[created.context_id]["is_primary"] is False
        assert kinds[created.context_id]["sessions"] == [client.session_id]
        primaries = [c for c in dev0["contexts"] if c["is_primary"]]
        assert len(primaries) == 1
        assert primaries[0]["sessions"] == [client.session_id]


def test_status_shows_the_primary_shared_by_sessions(daemon: DaemonProcess, client: Client) -> None:
    client.set_device(1)
    with Client(daemon.endpoint, timeout=10) as other:
        other.set_device(1)
        dev1 = device_status(client, 1)
        assert dev1["primary_context"]["active"] is True
        assert dev1["primary_context"]["references"] == 2
        primaries = [c for c in dev1["contexts"] if c["is_primary"]]
        assert len(primaries) == 1
        assert primaries[0]["sessions"] == sorted([client.session_id, other.session_id])
    dev1 = device_status(client, 1)
    assert dev1["primary_context"]["references"] == 1
    assert dev1["primary_context"]["active"] is True
