"""Device endpoints: each device's own socket, told in hello, answers its device ops (PROTOCOL.md section 3a).

Against real sim daemons: what hello tells, what a device endpoint accepts and
refuses (front ops, requests for another device, garbage), that the client's
routing keeps CUDA's current-device semantics and a session's order across
sockets, and that ``--no-device-endpoints`` and ``device_endpoints=False`` fall
back to the main endpoint.
"""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuctxd.client import AsyncClient, Client
from cuctxd.client.wire import build as wire
from tests.helpers import REPO, DaemonProcess, client_env, remove_tempdir, running_daemon, start_daemon
from tests.helpers_raw import RawPeer, error_name, raw_peer
from tests.reliability.strategies import fuzz_settings, garbage_headers, payload_junk, soak_mode


def device_endpoint(daemon: DaemonProcess, device: int) -> str:
    return f"{daemon.endpoint}-dev{device}"


@pytest.fixture
def peer(daemon: DaemonProcess) -> Iterator[tuple[RawPeer, str]]:
    """A raw session: its token, opened on the main endpoint."""
    with raw_peer(daemon.endpoint) as main:
        yield main, main.hello()


def test_hello_tells_each_devices_endpoint(daemon: DaemonProcess) -> None:
    with raw_peer(daemon.endpoint) as main:
        result, _ = main.ok("hello", {"protocol": 1, "client": "t", "pid": 1})
    assert result["endpoints"] == [daemon.endpoint]
    assert result["device_endpoints"] == [[device_endpoint(daemon, 0)], [device_endpoint(daemon, 1)]]
    for device in (0, 1):
        socket_file = Path(device_endpoint(daemon, device)[len("ipc://"):])
        assert stat.S_ISSOCK(socket_file.stat().st_mode)
        assert stat.S_IMODE(socket_file.stat().st_mode) == 0o600


def test_a_device_endpoint_runs_device_ops(daemon: DaemonProcess, peer: tuple[RawPeer, str]) -> None:
    _, token = peer
    with raw_peer(device_endpoint(daemon, 1)) as device_1:
        buffer, _ = device_1.ok("alloc", {"size": 64, "device": 1}, token)
        handle = buffer["buffer"]["handle"]
        device_1.ok("write", {"buffer": handle, "device": 1}, token, [b"\x07" * 64])
        _, frames = device_1.ok("read", {"buffer": handle, "device": 1, "size": 4}, token)
    assert frames == [b"\x07" * 4]


def test_a_device_endpoint_refuses_front_ops(daemon: DaemonProcess, peer: tuple[RawPeer, str]) -> None:
    _, token = peer
    with raw_peer(device_endpoint(daemon, 0)) as device_0:
        header, _ = device_0.call("ping")
        assert error_name(header) == "CUCTXD_ERROR_BAD_REQUEST"
        assert "main endpoint" in header["error"]["message"]
        header, _ = device_0.call("status", None, token)
        assert error_name(header) == "CUCTXD_ERROR_BAD_REQUEST"


def test_a_device_endpoint_refuses_another_devices_requests(daemon: DaemonProcess,
                                                           peer: tuple[RawPeer, str]) -> None:
    main, token = peer
    with raw_peer(device_endpoint(daemon, 0)) as device_0:
        header, _ = device_0.call("alloc", {"size": 64, "device": 1}, token)
        assert error_name(header) == "CUCTXD_ERROR_BAD_REQUEST"
        assert "device 1" in header["error"]["message"]
        main.ok("set_device", {"device": 1}, token)  # device 1 is now current: an op without device goes there
        header, _ = device_0.call("alloc", {"size": 64}, token)
        assert error_name(header) == "CUCTXD_ERROR_BAD_REQUEST"
    with raw_peer(device_endpoint(daemon, 1)) as device_1:
        result, _ = device_1.ok("alloc", {"size": 64}, token)
    assert result["buffer"]["device"] == 1


def test_a_device_endpoint_checks_sessions_like_the_front(daemon: DaemonProcess) -> None:
    with raw_peer(device_endpoint(daemon, 0)) as device_0:
        header, _ = device_0.call("alloc", {"size": 64})
        assert error_name(header) == "CUCTXD_ERROR_UNKNOWN_SESSION"
        header, _ = device_0.call("alloc", {"size": 64}, "no-such-token")
        assert error_name(header) == "CUCTXD_ERROR_UNKNOWN_SESSION"
        header, _ = device_0.call("alloc", {"size": 64, "device": 7}, "no-such-token")
        assert error_name(header) == "CUCTXD_ERROR_UNKNOWN_SESSION"


def test_set_device_on_a_device_endpoint_moves_the_current_device(daemon: DaemonProcess,
                                                                  peer: tuple[RawPeer, str]) -> None:
    main, token = peer
    with raw_peer(device_endpoint(daemon, 1)) as device_1:
        device_1.ok("set_device", {"device": 1}, token)
    result, _ = main.ok("get_device", None, token)
    assert result["device"] == 1


@pytest.fixture(scope="module")
def bystander(daemon: DaemonProcess) -> Iterator[tuple[str, int]]:
    """A session token and a buffer on device 0 holding :data:`KNOWN`, for checks after garbage."""
    with raw_peer(daemon.endpoint) as main:
        token = main.hello()
        result, _ = main.ok("alloc", {"size": len(KNOWN), "device": 0}, token)
        handle = result["buffer"]["handle"]
        main.ok("write", {"buffer": handle, "device": 0}, token, [KNOWN])
        yield token, handle
        main.ok("goodbye", None, token)


KNOWN = b"still serving..."


@pytest.mark.timeout(0 if soak_mode() else 120)
@given(header=garbage_headers, payload=st.lists(payload_junk, max_size=3))
@fuzz_settings(ci_examples=200)
def test_garbage_on_a_device_endpoint_gets_an_error_and_the_device_goes_on(
        daemon: DaemonProcess, bystander: tuple[str, int], header: bytes, payload: list[bytes]) -> None:
    token, handle = bystander
    with raw_peer(device_endpoint(daemon, 0)) as device_0:
        device_0.send_frames([header, *payload])
        reply, _ = device_0.recv()
        assert reply["ok"] is False
        assert reply["error"]["name"] != "CUCTXD_ERROR_INTERNAL", reply
        _, frames = device_0.ok("read", {"buffer": handle, "device": 0}, token)
    assert frames == [KNOWN]


def test_the_client_follows_set_device(client: Client) -> None:
    assert client.alloc(64).device == 0
    client.set_device(1)
    moved = client.alloc(64)
    assert moved.device == 1
    assert client.current_context() is not None
    assert client.current_context(device=0) is not None
    assert client.get_device() == 1


def test_a_pipeline_keeps_order_across_devices_and_front_ops(client: Client) -> None:
    on_0 = client.alloc(64, device=0)
    on_1 = client.alloc(64, device=1)
    with client.pipeline() as p:
        p.write(on_0, b"a" * 64)
        p.write(on_1, b"b" * 64)
        p.copy(on_0, on_1, 32)  # device 0's worker, then device 1's: after the write on device 1
        status = p.send(wire.status())  # a front op: after everything before it
        p.fill(on_1, ord("c"), 48, 16)
        read = p.read(on_1)
    assert read.result() == b"a" * 32 + b"b" * 16 + b"c" * 16
    sessions = [s for d in status.result()["devices"] for s in d["sessions"] if s["session"] == client.session_id]
    assert sum(s["allocations"] for s in sessions) == 2


def test_a_client_can_use_the_main_endpoint_only(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, timeout=10, device_endpoints=False) as session:
        session.set_device(1)
        buffer = session.alloc(32)
        buffer.write(b"x" * 32)
        assert buffer.read(4) == b"xxxx"
        assert not session._router.device_sockets


def test_a_daemon_without_device_endpoints_serves_everything_on_the_main_one() -> None:
    with running_daemon("--sim-devices", "2", "--no-device-endpoints") as daemon:
        with raw_peer(daemon.endpoint) as main:
            result, _ = main.ok("hello", {"protocol": 1, "client": "t", "pid": 1})
        assert result["device_endpoints"] == []
        assert not Path(device_endpoint(daemon, 0)[len("ipc://"):]).exists()
        with Client(daemon.endpoint, timeout=10) as session:
            assert session.alloc(16, device=1).device == 1


def test_device_endpoints_go_away_with_the_daemon() -> None:
    daemon = start_daemon("--sim-devices", "2")
    files = [Path(device_endpoint(daemon, n)[len("ipc://"):]) for n in (0, 1)]
    assert all(f.exists() for f in files)
    assert daemon.stop() == 0
    assert not any(f.exists() for f in files)
    remove_tempdir(daemon.socket_dir)


def test_over_tcp_the_client_reaches_device_endpoints_by_the_host_it_used() -> None:
    with running_daemon("--sim-devices", "1", "--insecure-tcp", "--endpoint", "tcp://127.0.0.1:*") as daemon:
        with raw_peer(daemon.endpoint) as main:
            result, _ = main.ok("hello", {"protocol": 1, "client": "t", "pid": 1})
        tcp_main = next(e for e in result["endpoints"] if e.startswith("tcp://"))
        port = tcp_main.rpartition(":")[2]
        code = ("from client import Client\n"
                f"with Client('tcp://localhost:{port}', timeout=10) as c:\n"
                "    b = c.alloc(8); b.write(b'tcp path'); print(b.read().decode(), c._router.routes.endpoints)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=client_env(), cwd=REPO, check=True).stdout
        assert out.startswith("tcp path ['tcp://localhost:")
        assert tcp_main.rpartition(":")[2] not in out.split("[", 1)[1]  # its own port, not the main one



def test_the_async_client_routes_like_the_sync_one(daemon: DaemonProcess) -> None:
    async def body() -> tuple[int, int, bytes, int]:
        async with AsyncClient(daemon.endpoint, timeout=10) as session:
            await session.set_device(1)
            moved = await session.alloc(64)
            on_0 = await session.alloc(64, device=0)
            async with session.pipeline() as p:
                p.write(on_0, b"a" * 64)
                p.write(moved, b"b" * 64)
                p.copy(on_0, moved, 32)
                p.send(wire.status())
                p.fill(moved, ord("c"), 48, 16)
                read = p.read(moved)
                device = p.send(wire.get_device())
            return moved.device, len(session._router.device_sockets), read.result(), device.result()

    moved_device, sockets_used, data, current = asyncio.run(body())
    assert moved_device == 1 and current == 1
    assert sockets_used == 2
    assert data == b"a" * 32 + b"b" * 16 + b"c" * 16


def test_many_async_tasks_share_the_device_endpoints(daemon: DaemonProcess) -> None:
    async def body() -> list[bytes]:
        async with AsyncClient(daemon.endpoint, timeout=10) as session:
            buffers = [await session.alloc(16, device=n % 2) for n in range(8)]

            async def round_trip(n: int) -> bytes:
                await buffers[n].write(bytes([n]) * 16)
                return await buffers[n].read()

            return await asyncio.gather(*(round_trip(n) for n in range(8)))

    assert asyncio.run(body()) == [bytes([n]) * 16 for n in range(8)]


def test_the_async_client_can_use_the_main_endpoint_only(daemon: DaemonProcess) -> None:
    async def body() -> tuple[bytes, int]:
        async with AsyncClient(daemon.endpoint, timeout=10, device_endpoints=False) as session:
            buffer = await session.alloc(8, device=1)
            await buffer.write(b"12345678")
            return await buffer.read(), len(session._router.device_sockets)

    assert asyncio.run(body()) == (b"12345678", 0)
