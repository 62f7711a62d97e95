"""First contact (issue 15): what a new user does, against a real daemon process, and what they see."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from cuctxd.client import (
    AsyncClient,
    Buffer,
    Client,
    DaemonTimeout,
    NoDaemon,
    SessionLost,
    UnknownHandle,
)
from tests.helpers import DaemonProcess, freeze, remove_tempdir, short_tempdir, start_daemon


@pytest.fixture
def lone_daemon() -> Iterator[DaemonProcess]:
    """A daemon of the test's own, which the test may stop and start again on the same endpoint."""
    process = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB")
    yield process
    process.stop()
    remove_tempdir(process.socket_dir)


def restart(daemon: DaemonProcess, request: pytest.FixtureRequest) -> None:
    """Start a daemon again on ``daemon``'s endpoint, stopped when the test ends."""
    again = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB", endpoint=daemon.endpoint)
    request.addfinalizer(again.stop)


def test_no_daemon_fails_at_once_and_says_how_to_start_one() -> None:
    directory = short_tempdir()
    endpoint = f"ipc://{directory}/nobody.sock"
    try:
        for make in (lambda: Client(endpoint), lambda: asyncio.run(AsyncClient(endpoint).open())):
            started = time.monotonic()
            with pytest.raises(NoDaemon) as info:
                make()
            assert time.monotonic() - started < 1.0
            assert f"no cuctxd is listening at {endpoint}; start it with `cuctxd`" in str(info.value)
            assert "(0)" not in str(info.value) and "CUCTXD_NO_DAEMON" in str(info.value)
    finally:
        remove_tempdir(directory)


def test_a_tcp_endpoint_with_nothing_listening_fails_at_once_not_after_the_timeout() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bound:
        bound.bind(("127.0.0.1", 0))  # bound, never listening: the port refuses connections, and no one takes it
        endpoint = f"tcp://127.0.0.1:{bound.getsockname()[1]}"
        for make in (lambda: Client(endpoint, timeout=30),
                     lambda: asyncio.run(AsyncClient(endpoint, timeout=30).open())):
            started = time.monotonic()
            with pytest.raises(NoDaemon, match=f"no cuctxd is listening at {endpoint}"):
                make()
            assert time.monotonic() - started < 3.0, "waited the timeout"


def test_client_side_errors_print_their_name_without_a_code() -> None:
    assert str(DaemonTimeout("no reply", "ping")) == "ping: CUCTXD_TIMEOUT: no reply"
    assert str(UnknownHandle("no buffer 0x1f", "free")) == "free: CUCTXD_ERROR_UNKNOWN_HANDLE (10004): no buffer 0x1f"


def test_the_handshake_has_its_own_short_timeout(lone_daemon: DaemonProcess) -> None:
    freeze(lone_daemon.process.pid)  # the socket listens, nobody answers
    try:
        started = time.monotonic()
        with pytest.raises(DaemonTimeout) as info:
            Client(lone_daemon.endpoint, timeout=30, hello_timeout=0.5)
        assert time.monotonic() - started < 3.0
        assert info.value.op == "hello" and lone_daemon.endpoint in str(info.value)
    finally:
        lone_daemon.process.send_signal(18)  # SIGCONT


def test_a_daemon_that_went_away_is_a_lost_session_and_reconnect_starts_a_new_one(
        lone_daemon: DaemonProcess, request: pytest.FixtureRequest) -> None:
    client = Client(lone_daemon.endpoint, timeout=30)
    try:
        buffer = client.alloc(64)
        assert lone_daemon.stop() == 0
        started = time.monotonic()
        with pytest.raises(SessionLost) as info:
            buffer.read()
        assert time.monotonic() - started < 3.0, "waited the full timeout"
        assert lone_daemon.endpoint in str(info.value) and "sock-dev" not in str(info.value)
        assert "gone" in str(info.value)
        assert f"the daemon at {lone_daemon.endpoint} stopped: nothing listens there any more (start it again with " \
            "`cuctxd`)" in str(info.value)  # a sentence, not "start it with `cuctxd` any more"
        with pytest.raises(SessionLost):
            client.device_count()  # at once, without a round trip
        restart(lone_daemon, request)
        client.reconnect()
        fresh = client.alloc(16)
        fresh.write(b"after a restart!")
        assert fresh.read() == b"after a restart!"
    finally:
        client.close()


def test_a_restarted_daemon_is_a_lost_session_and_reconnect_true_recovers(
        lone_daemon: DaemonProcess, request: pytest.FixtureRequest) -> None:
    client = Client(lone_daemon.endpoint, timeout=10, reconnect=True)
    try:
        client.alloc(64)
        assert lone_daemon.stop() == 0
        restart(lone_daemon, request)
        with pytest.raises(SessionLost, match="no longer knows this session"):
            client.device_count()
        assert client.device_count() == 2  # the next call started a new session by itself
        assert client.alloc(8).read() == bytes(8)
    finally:
        client.close()


def test_async_client_names_a_lost_session_too(lone_daemon: DaemonProcess, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with AsyncClient(lone_daemon.endpoint, timeout=30) as client:
            buffer = await client.alloc(64)
            assert lone_daemon.stop() == 0
            started = time.monotonic()
            with pytest.raises(SessionLost):
                await buffer.read()
            assert time.monotonic() - started < 3.0
            restart(lone_daemon, request)
            await client.reconnect()
            assert await client.device_count() == 2

    asyncio.run(main())


@pytest.mark.parametrize("route", ["object", "client"])
def test_freeing_twice_is_one_rule_on_both_routes(lone_daemon: DaemonProcess, route: str) -> None:
    with Client(lone_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(64)
        for _ in range(2):
            buffer.free() if route == "object" else client.free(buffer)
            assert buffer.freed
        buffer.free()
        client.free(buffer)
        with pytest.raises(UnknownHandle, match=f"{buffer.handle:#x}"):
            client.free(Buffer(client, buffer.record))  # a raw handle the daemon no longer knows


@pytest.mark.parametrize("route", ["object", "client"])
def test_async_freeing_twice_is_one_rule_on_both_routes(lone_daemon: DaemonProcess, route: str) -> None:
    async def main() -> None:
        async with AsyncClient(lone_daemon.endpoint, timeout=10) as client:
            buffer = await client.alloc(64)
            for _ in range(2):
                await (buffer.free() if route == "object" else client.free(buffer))
                assert buffer.freed

    asyncio.run(main())


def test_handles_print_in_hex_in_reprs_and_errors(lone_daemon: DaemonProcess) -> None:
    with Client(lone_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(64)
        stream = client.create_stream()
        assert f"handle={buffer.handle:#x}" in repr(buffer) and f"handle={stream.handle:#x}" in repr(stream)
        assert stream.device == 0 and client.create_event(1).device == 1
        buffer.free()
        with pytest.raises(UnknownHandle) as info:
            Buffer(client, buffer.record).read()
        assert f"{buffer.handle:#x}" in str(info.value)


def test_a_property_a_share_does_not_have_is_an_attribute_error(lone_daemon: DaemonProcess) -> None:
    with Client(lone_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(64, shareable=True)
        with client.open_shared(buffer.export()) as share:
            assert not hasattr(share, "__cuda_array_interface__")
            assert not hasattr(share, "ptr")
            with pytest.raises(AttributeError, match="host_view"):
                share.ptr  # noqa: B018
            assert len(share.host_view()) == 64
