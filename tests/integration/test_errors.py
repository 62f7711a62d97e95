"""Every error path a client can reach, and hostile input on a raw socket.

Each error is checked by its stable ``name``. After each piece of hostile input
the daemon must still answer, and another session's memory must be untouched.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.client import (
    BadArgument,
    Buffer,
    Client,
    ConnectionLost,
    Context,
    CuctxError,
    CudaError,
    OutOfRange,
    TooLarge,
    UnknownHandle,
    UnknownSession,
    VersionMismatch,
)
from cuctxd.client.wire import build
from cuctxd.client.wire.socket_transport import Transport
from cuctxd.protos.messages import pack
from cuctxd.protos.records import BufferRecord, ContextRecord
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon
from tests.helpers_raw import RawPeer, error_name, raw_peer


@pytest.fixture
def client(routed_client: Client) -> Client:
    """Every test here runs through the device endpoints and through the main endpoint only."""
    return routed_client


MiB = 1 << 20
SMALL_PAYLOAD = 64 * 1024

UNKNOWN_HANDLE = "CUCTXD_ERROR_UNKNOWN_HANDLE"
OUT_OF_RANGE = "CUCTXD_ERROR_OUT_OF_RANGE"


def fake_buffer(client: Client, device: int = 0, size: int = 4096) -> Buffer:
    return Buffer(client, BufferRecord(handle=0x1234_5677, device=device, size=size, context=0x99))


def fake_context(client: Client, device: int = 0) -> Context:
    return Context(client, ContextRecord(handle=0x4321_8765, device=device, is_primary=False, api_version=3020,
                                         flags=0, context_id=999))


def raises_named(name: str, call: Any, *args: Any, **kwargs: Any) -> CuctxError:
    with pytest.raises(CuctxError) as info:
        call(*args, **kwargs)
    assert info.value.name == name, str(info.value)
    return info.value


# --- handles -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda c, b, x: c.free(b),
        lambda c, b, x: c.read(b, 16),
        lambda c, b, x: c.write(b, b"data"),
        lambda c, b, x: c.fill(b, 1),
        lambda c, b, x: c.copy(b, x, 16),
        lambda c, b, x: c.copy(x, b, 16),
        lambda c, b, x: c.copy(x, Buffer(c, BufferRecord(b.handle, 1, 4096, 1)), 16),
        lambda c, b, x: c.read_into(b, bytearray(16)),
    ],
    ids=["free", "read", "write", "fill", "copy-src", "copy-dst", "copy-dst-other-device", "read-into"],
)
def test_unknown_buffer_handle(client: Client, call: Any) -> None:
    real = client.alloc(4096)
    error = raises_named(UNKNOWN_HANDLE, call, client, fake_buffer(client), real)
    assert isinstance(error, UnknownHandle)
    assert error.code == 10004


@pytest.mark.parametrize(
    "call",
    [lambda c, x: c.push_context(x), lambda c, x: c.destroy_context(x), lambda c, x: c.context_info(x)],
    ids=["push", "destroy", "info"],
)
def test_unknown_context_handle(client: Client, call: Any) -> None:
    raises_named(UNKNOWN_HANDLE, call, client, fake_context(client))
    assert client.context_stack() == []


def test_a_handle_is_only_known_on_its_own_device(client: Client) -> None:
    buffer = client.alloc(64, device=0)
    context = client.create_context(device=0)
    raises_named(UNKNOWN_HANDLE, client.read, Buffer(client, dataclasses.replace(buffer.record, device=1)))
    raises_named(UNKNOWN_HANDLE, client.push_context, Context(client, dataclasses.replace(context.record, device=1)))


def test_a_raw_handle_freed_twice_is_unknown(client: Client) -> None:
    """Freeing the same Buffer object twice is a no-op (tests/integration/test_first_contact.py); a second
    object for a handle already freed is what the daemon no longer knows."""
    buffer = client.alloc(256)
    client.free(buffer)
    raises_named(UNKNOWN_HANDLE, client.free, Buffer(client, buffer.record))


def test_a_buffer_dies_with_its_context(client: Client) -> None:
    context = client.create_context()
    buffer = client.alloc(1024)
    buffer.write(b"x" * 1024)
    free_before = client.mem_get_info()[0]
    context.destroy()
    assert client.mem_get_info()[0] == free_before + 1024
    for call in (buffer.read, lambda: buffer.write(b"y"), buffer.fill, lambda: client.free(buffer)):
        raises_named(UNKNOWN_HANDLE, call)


def test_a_destroyed_context_handle_is_unknown(client: Client) -> None:
    context = client.create_context()
    context.destroy()
    raises_named(UNKNOWN_HANDLE, context.push)
    raises_named(UNKNOWN_HANDLE, context.destroy)
    raises_named(UNKNOWN_HANDLE, context.info)
    assert client.context_stack() == []


def test_destroying_the_primary_context_is_invalid_context(client: Client) -> None:
    primary = client.set_device(0)
    raises_named("CUDA_ERROR_INVALID_CONTEXT", primary.destroy)
    current = client.current_context()
    assert current is not None and current.handle == primary.handle


# --- devices and contexts ------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.set_device(2),
        lambda c: c.set_device(1000),
        lambda c: c.alloc(16, device=2),
        lambda c: c.current_context(device=2),
        lambda c: c.context_stack(device=3),
        lambda c: c.create_context(device=2),
        lambda c: c.pop_context(device=2),
        lambda c: c.synchronize(device=2),
        lambda c: c.device_synchronize(device=2),
        lambda c: c.mem_get_info(device=9),
        lambda c: c.read(Buffer(c, BufferRecord(5, 2, 16, 1))),
    ],
    ids=["set_device-2", "set_device-1000", "alloc", "current_context", "context_stack", "create_context",
         "pop_context", "synchronize", "device_synchronize", "mem_get_info", "read"],
)
def test_bad_device_index_is_invalid_device(client: Client, call: Any) -> None:
    error = raises_named("CUDA_ERROR_INVALID_DEVICE", call, client)
    assert isinstance(error, CudaError)
    assert error.code == 101


def test_bad_device_does_not_change_the_current_device(client: Client) -> None:
    client.set_device(1)
    raises_named("CUDA_ERROR_INVALID_DEVICE", client.set_device, 2)
    assert client.get_device() == 1


def test_copy_to_a_device_that_does_not_exist(client: Client) -> None:
    src = client.alloc(64)
    raises_named("CUDA_ERROR_INVALID_DEVICE", client.copy, src, Buffer(client, BufferRecord(src.handle, 5, 64, 1)))


def test_negative_device_is_bad_argument(client: Client) -> None:
    with pytest.raises(BadArgument, match="'device'"):
        client.alloc(16, device=-1)


def test_pop_on_an_empty_stack_is_invalid_context(client: Client) -> None:
    error = raises_named("CUDA_ERROR_INVALID_CONTEXT", client.pop_context)
    assert error.code == 201
    primary = client.set_device(0)
    assert client.pop_context().handle == primary.handle
    raises_named("CUDA_ERROR_INVALID_CONTEXT", client.pop_context)


def test_bad_context_flags_are_invalid_value(client: Client) -> None:
    raises_named("CUDA_ERROR_INVALID_VALUE", client.create_context, flags=0x03)
    assert client.context_stack() == []


# --- memory --------------------------------------------------------------------------------


def test_alloc_zero_is_invalid_value(client: Client) -> None:
    error = raises_named("CUDA_ERROR_INVALID_VALUE", client.alloc, 0)
    assert error.message.startswith("invalid argument")


def test_alloc_beyond_device_memory_is_out_of_memory(client: Client) -> None:
    free_before, total = client.mem_get_info()
    raises_named("CUDA_ERROR_OUT_OF_MEMORY", client.alloc, total + 1)
    big = client.alloc(40 * MiB)
    raises_named("CUDA_ERROR_OUT_OF_MEMORY", client.alloc, 40 * MiB)
    assert client.mem_get_info()[0] == free_before - 40 * MiB
    big.free()
    client.alloc(40 * MiB).free()  # the memory really came back


def test_negative_size_is_bad_argument(client: Client) -> None:
    with pytest.raises(BadArgument, match="'size'"):
        client.alloc(-1)


@pytest.mark.parametrize(
    "call",
    [
        lambda b, o: b.read(1, offset=101),
        lambda b, o: b.read(101),
        lambda b, o: b.read(51, offset=50),
        lambda b, o: b.read_into(bytearray(2), offset=99),
        lambda b, o: b.write(b"x" * 101),
        lambda b, o: b.write(b"xy", offset=99),
        lambda b, o: b.write(b"", offset=101),
        lambda b, o: b.fill(1, offset=101),
        lambda b, o: b.fill(1, offset=10, size=91),
        lambda b, o: b.copy_to(o, 101),
        lambda b, o: b.copy_to(o, 10, src_offset=95),
        lambda b, o: b.copy_to(o, 10, dst_offset=95),
        lambda b, o: b.copy_to(o, src_offset=101),
        lambda b, o: b.read(1, offset=(1 << 63) - 1),
        lambda b, o: b.read((1 << 63) - 1, offset=1),
    ],
    ids=["read-offset", "read-size", "read-range", "read-into", "write-size", "write-range", "write-offset",
         "fill-offset", "fill-range", "copy-size", "copy-src-range", "copy-dst-range", "copy-src-offset",
         "read-huge-offset", "read-huge-size"],
)
def test_out_of_range(client: Client, call: Any) -> None:
    buffer = client.alloc(100)
    other = client.alloc(100)
    buffer.write(bytes(range(100)))
    other.fill(0x55)
    error = raises_named(OUT_OF_RANGE, call, buffer, other)
    assert isinstance(error, OutOfRange)
    assert buffer.read() == bytes(range(100))
    assert other.read() == b"\x55" * 100


@pytest.mark.parametrize(
    ("size", "src_offset", "dst_offset"), [(101, 0, 0), (10, 95, 0), (10, 0, 95), (1, 0, 100)]
)
def test_out_of_range_across_devices(client: Client, size: int, src_offset: int, dst_offset: int) -> None:
    src = client.alloc(100, device=0)
    dst = client.alloc(100, device=1)
    dst.fill(0x77)
    raises_named(OUT_OF_RANGE, src.copy_to, dst, size, src_offset=src_offset, dst_offset=dst_offset)
    assert dst.read() == b"\x77" * 100


def test_fill_value_must_be_a_byte(client: Client) -> None:
    buffer = client.alloc(16)
    with pytest.raises(BadArgument, match="'value'"):
        buffer.fill(256)


# --- payload limits ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_daemon() -> Iterator[DaemonProcess]:
    """A daemon whose payload frames may carry at most 64 KiB."""
    process = start_daemon("--sim-devices", "1", "--sim-memory", "16MiB", "--max-payload", str(SMALL_PAYLOAD))
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()}"


def test_read_larger_than_max_payload_is_too_large(small_daemon: DaemonProcess) -> None:
    with Client(small_daemon.endpoint, timeout=10) as client:
        assert client.limits["max_payload_bytes"] == SMALL_PAYLOAD
        buffer = client.alloc(SMALL_PAYLOAD + 1)
        buffer.fill(3)
        frame = build.read_frame(buffer, None, 0, None)  # the socket path: one reply frame
        error = raises_named("CUCTXD_ERROR_TOO_LARGE", client.run, frame)
        assert isinstance(error, TooLarge)
        raises_named("CUCTXD_ERROR_TOO_LARGE", client.run, build.read_into(buffer, bytearray(SMALL_PAYLOAD + 1), 0,
                                                                              None))
        assert buffer.read(SMALL_PAYLOAD) == b"\x03" * SMALL_PAYLOAD
        assert buffer.read(offset=SMALL_PAYLOAD) == b"\x03"
        assert buffer.read() == b"\x03" * (SMALL_PAYLOAD + 1)  # the staging ring carries no frame at all


def test_write_larger_than_max_payload_is_too_large(small_daemon: DaemonProcess) -> None:
    with Client(small_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(4 * SMALL_PAYLOAD)
        raises_named("CUCTXD_ERROR_TOO_LARGE", client.run,
                     build.write(buffer, b"\x01" * (SMALL_PAYLOAD + 1), 0, None, SMALL_PAYLOAD))
        assert buffer.read(SMALL_PAYLOAD) == bytes(SMALL_PAYLOAD)
        assert buffer.write(b"\x02" * SMALL_PAYLOAD) == SMALL_PAYLOAD
        assert buffer.read(SMALL_PAYLOAD) == b"\x02" * SMALL_PAYLOAD


def test_a_frame_beyond_the_socket_limit_is_dropped_and_the_daemon_goes_on(small_daemon: DaemonProcess) -> None:
    """Past max-payload + header limit libzmq itself drops the message and the peer."""
    with Client(small_daemon.endpoint, timeout=10) as victim, raw_peer(small_daemon.endpoint) as peer:
        buffer = victim.alloc(1024)
        buffer.write(b"v" * 1024)
        peer.send_frames([os.urandom(SMALL_PAYLOAD + (1 << 20) + 4096)])
        assert not peer.has_reply(0.5)
        with raw_peer(small_daemon.endpoint) as fresh:
            assert fresh.ok("ping")[0].keys() == {"instance"}
        assert buffer.read() == b"v" * 1024


# --- sessions and versions -------------------------------------------------------------------


def test_version_mismatch_in_hello(daemon: DaemonProcess) -> None:
    transport = Transport(daemon.endpoint, timeout=10)
    try:
        for protocol in (0, PROTOCOL_VERSION + 1, 1000):
            with pytest.raises(VersionMismatch) as info:
                transport.call("hello", {"protocol": protocol}, None)
            assert info.value.name == "CUCTXD_ERROR_VERSION_MISMATCH"
            assert str(PROTOCOL_VERSION) in info.value.message
    finally:
        transport.close()


def test_hello_without_a_protocol_is_bad_argument(daemon: DaemonProcess) -> None:
    transport = Transport(daemon.endpoint, timeout=10)
    try:
        with pytest.raises(BadArgument, match="'protocol'"):
            transport.call("hello", {}, None)
    finally:
        transport.close()


@pytest.mark.parametrize("op", ["alloc", "device_count", "status", "get_device", "goodbye", "set_device"])
def test_request_without_a_session_is_unknown_session(daemon: DaemonProcess, op: str) -> None:
    transport = Transport(daemon.endpoint, timeout=10)
    try:
        args = {"size": 8} if op == "alloc" else {}
        for token in (None, "", "0" * 32, "not-a-token"):
            with pytest.raises(UnknownSession) as info:
                transport.call(op, args, token)
            assert info.value.name == "CUCTXD_ERROR_UNKNOWN_SESSION"
        assert transport.call("ping", {}, None)[0].keys() == {"instance"}
    finally:
        transport.close()


def test_after_goodbye_the_token_is_rejected(daemon: DaemonProcess) -> None:
    with raw_peer(daemon.endpoint) as peer:
        token = peer.hello()
        handle = peer.ok("alloc", {"size": 64}, token)[0]["buffer"]["handle"]
        assert peer.ok("goodbye", {}, token)[0] == {}
        for op, args in (("device_count", {}), ("read", {"buffer": handle}), ("goodbye", {})):
            header, _ = peer.call(op, args, token)
            assert error_name(header) == "CUCTXD_ERROR_UNKNOWN_SESSION"
        assert peer.ok("ping")[0].keys() == {"instance"}


def test_a_closed_client_raises_connection_lost(daemon: DaemonProcess) -> None:
    client = Client(daemon.endpoint, timeout=10)
    client.close()
    with pytest.raises(ConnectionLost):
        client.ping()
    client.close()  # closing twice is fine


# --- hostile input on a raw socket -----------------------------------------------------------


@pytest.fixture(scope="module")
def victim(daemon: DaemonProcess) -> Iterator[tuple[Client, Buffer, bytes]]:
    """Another session whose buffer must survive everything the hostile peer sends."""
    data = os.urandom(64 * 1024)
    with Client(daemon.endpoint, timeout=10, name="victim") as client:
        buffer = client.alloc(len(data), device=1)
        buffer.write(data)
        yield client, buffer, data


@pytest.fixture
def peer(daemon: DaemonProcess) -> Iterator[RawPeer]:
    with raw_peer(daemon.endpoint) as raw:
        yield raw


def assert_daemon_unharmed(daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes]) -> None:
    with raw_peer(daemon.endpoint) as fresh:
        assert fresh.ok("ping")[0].keys() == {"instance"}
    client, buffer, data = victim
    assert client.ping() > 0
    assert buffer.read() == data


def hostile_frames(token: str, handle: int) -> dict[str, tuple[list[bytes], int, str]]:
    """name -> (frames, expected reply id, expected error name)."""
    return {
        "undecodable-header": ([b"\xc1\xff\x00garbage"], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "truncated-header": ([pack({"id": 3, "op": "ping"})[:-2]], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "empty-frame": ([b""], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "two-empty-frames": ([b"", b""], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "array-header": ([pack([1, "ping"])], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "int-header": ([pack(7)], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "binary-header": ([pack(b"\x81\xa2id\x01")], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "missing-id": ([pack({"op": "ping"})], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "negative-id": ([pack({"id": -4, "op": "ping"})], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "bool-id": ([pack({"id": True, "op": "ping"})], 0, "CUCTXD_ERROR_BAD_REQUEST"),
        "missing-op": ([pack({"id": 11})], 11, "CUCTXD_ERROR_BAD_REQUEST"),
        "int-op": ([pack({"id": 12, "op": 5})], 12, "CUCTXD_ERROR_BAD_REQUEST"),
        "unknown-op": ([pack({"id": 13, "op": "launch_kernel"})], 13, "CUCTXD_ERROR_BAD_OP"),
        "unknown-op-with-session": (
            [pack({"id": 14, "op": "rm_rf", "session": token})], 14, "CUCTXD_ERROR_BAD_OP"),
        "int-session": ([pack({"id": 15, "op": "device_count", "session": 42})], 15, "CUCTXD_ERROR_BAD_REQUEST"),
        "wrong-arg-type": (
            [pack({"id": 16, "op": "alloc", "session": token, "args": {"size": "huge"}})],
            16, "CUCTXD_ERROR_BAD_ARGUMENT"),
        "bool-arg": (
            [pack({"id": 17, "op": "read", "session": token, "args": {"buffer": True}})],
            17, "CUCTXD_ERROR_BAD_ARGUMENT"),
        "args-not-a-map": (
            [pack({"id": 18, "op": "alloc", "session": token, "args": [64]})], 18, "CUCTXD_ERROR_BAD_ARGUMENT"),
        "handle-out-of-range": (
            [pack({"id": 19, "op": "free", "session": token, "args": {"buffer": 1 << 63}})],
            19, "CUCTXD_ERROR_BAD_ARGUMENT"),
        "payload-on-ping": ([pack({"id": 20, "op": "ping"}), b"extra"], 20, "CUCTXD_ERROR_BAD_REQUEST"),
        "payload-on-alloc": (
            [pack({"id": 21, "op": "alloc", "session": token, "args": {"size": 8}}), b"x", b"y"],
            21, "CUCTXD_ERROR_BAD_REQUEST"),
        "write-without-payload": (
            [pack({"id": 22, "op": "write", "session": token, "args": {"buffer": handle}})],
            22, "CUCTXD_ERROR_BAD_REQUEST"),
        "write-with-two-payloads": (
            [pack({"id": 23, "op": "write", "session": token, "args": {"buffer": handle}}), b"a", b"b"],
            23, "CUCTXD_ERROR_BAD_REQUEST"),
        "huge-junk": ([os.urandom(2 * MiB)], 0, "CUCTXD_ERROR_TOO_LARGE"),
        "huge-header-map": ([pack({"id": 24, "op": "ping", "pad": "p" * (2 * MiB)})], 0, "CUCTXD_ERROR_TOO_LARGE"),
    }


_CASES = sorted(hostile_frames("t", 1))


@pytest.mark.parametrize("case", _CASES)
def test_hostile_input_gets_an_error_reply_and_harms_nobody(
    daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes], peer: RawPeer, case: str
) -> None:
    token = peer.hello()
    handle = peer.ok("alloc", {"size": 64}, token)[0]["buffer"]["handle"]
    frames, rid, name = hostile_frames(token, handle)[case]
    peer.send_frames(frames)
    header, payload = peer.recv()
    assert header["id"] == rid
    assert error_name(header) == name, header["error"]
    assert set(header["error"]) == {"code", "name", "message"}
    assert "Traceback" not in header["error"]["message"]
    assert payload == []
    # The hostile peer's own session still works, and so does everyone else's.
    assert peer.ok("read", {"buffer": handle, "size": 4}, token)[1] == [bytes(4)]
    assert_daemon_unharmed(daemon, victim)


@pytest.mark.parametrize("op", ["write", "read", "fill", "free"])
def test_another_sessions_buffer_handle_is_unknown_on_the_wire(
    daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes], peer: RawPeer, op: str
) -> None:
    token = peer.hello()
    payload = [b"overwritten"] if op == "write" else []
    header, _ = peer.call(op, {"buffer": victim[1].handle, "device": 1}, token, payload)
    assert error_name(header) == UNKNOWN_HANDLE
    assert_daemon_unharmed(daemon, victim)


def test_a_peer_that_vanishes_before_its_reply_harms_nobody(
    daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes]
) -> None:
    with raw_peer(daemon.endpoint) as leaving:
        token = leaving.hello()
        handle = leaving.ok("alloc", {"size": 16 * MiB, "device": 0}, token)[0]["buffer"]["handle"]
        for value in range(8):
            leaving.send("fill", {"buffer": handle, "value": value, "device": 0}, token)
        leaving.send("read", {"buffer": handle, "device": 0}, token)
    assert_daemon_unharmed(daemon, victim)


def test_a_burst_of_garbage_is_answered_in_order(
    daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes], peer: RawPeer
) -> None:
    for n in range(200):
        peer.send_frames([pack({"id": n + 1, "op": f"junk-{n}"})])
    ids = [peer.recv()[0]["id"] for _ in range(200)]
    assert ids == list(range(1, 201))
    assert_daemon_unharmed(daemon, victim)


def test_a_peer_that_never_reads_replies_does_not_block_others(
    daemon: DaemonProcess, victim: tuple[Client, Buffer, bytes], peer: RawPeer
) -> None:
    for n in range(2000):
        peer.send_frames([pack({"id": n + 1, "op": "ping"})])
    assert_daemon_unharmed(daemon, victim)
