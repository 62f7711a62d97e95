"""Sessions are separate host threads: no shared stacks, no shared handles, no leaked memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.client import Buffer, Client, Context, CuctxError
from tests.helpers import DaemonProcess

MiB = 1 << 20


@pytest.fixture
def other(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.endpoint, timeout=10, name="other") as session:
        yield session


def as_seen_by(client: Client, buffer: Buffer) -> Buffer:
    """The same handle, sent by another session."""
    return Buffer(client, buffer.record)


def context_as_seen_by(client: Client, context: Context) -> Context:
    return Context(client, context.record)


def device_entries(client: Client, session_id: int) -> list[dict[str, Any]]:
    return [s for d in client.status()["devices"] for s in d["sessions"] if s["session"] == session_id]


def test_stacks_are_per_session(client: Client, other: Client) -> None:
    a_primary = client.set_device(0)
    a_created = client.create_context()
    other.create_context()
    other.create_context()
    other.set_device(0)
    other.pop_context()
    assert [c.handle for c in client.context_stack()] == [a_primary.handle, a_created.handle]
    assert len(other.context_stack()) == 1
    assert other.current_context(device=1) is None
    client.pop_context()
    client.pop_context()
    assert client.context_stack() == []
    assert len(other.context_stack()) == 1


def test_current_device_is_per_session(client: Client, other: Client) -> None:
    client.set_device(1)
    assert other.get_device() == 0
    other.set_device(0)
    assert client.get_device() == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda c, b: c.read(b),
        lambda c, b: c.write(b, b"intruder"),
        lambda c, b: c.fill(b, 0),
        lambda c, b: c.free(b),
        lambda c, b: c.copy(b, b),
        lambda c, b: c.read_into(b, bytearray(16)),
    ],
    ids=["read", "write", "fill", "free", "copy", "read_into"],
)
def test_another_sessions_buffer_is_an_unknown_handle(client: Client, other: Client, call: Any) -> None:
    buffer = client.alloc(4096, device=1)
    buffer.write(b"secret" * 100)
    with pytest.raises(CuctxError) as info:
        call(other, as_seen_by(other, buffer))
    assert info.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"
    assert buffer.read(600) == b"secret" * 100


def test_copy_cannot_reach_into_another_session(client: Client, other: Client) -> None:
    mine = other.alloc(4096)
    mine.write(b"m" * 4096)
    theirs = client.alloc(4096)
    theirs.write(b"t" * 4096)
    for src, dst in ((mine, as_seen_by(other, theirs)), (as_seen_by(other, theirs), mine)):
        with pytest.raises(CuctxError) as info:
            other.copy(src, dst)
        assert info.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"
    assert theirs.read() == b"t" * 4096
    assert mine.read() == b"m" * 4096


@pytest.mark.parametrize(
    "call",
    [lambda c, x: c.push_context(x), lambda c, x: c.destroy_context(x), lambda c, x: c.context_info(x)],
    ids=["push", "destroy", "info"],
)
def test_another_sessions_context_is_an_unknown_handle(client: Client, other: Client, call: Any) -> None:
    created = client.create_context()
    with pytest.raises(CuctxError) as info:
        call(other, context_as_seen_by(other, created))
    assert info.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"
    assert [c.handle for c in client.context_stack()] == [created.handle]
    assert other.context_stack() == []
    assert created.info().handle == created.handle  # still alive


def test_another_sessions_primary_handle_is_unknown(client: Client, other: Client) -> None:
    primary = client.set_device(0)
    with pytest.raises(CuctxError) as info:
        other.push_context(context_as_seen_by(other, primary))
    assert info.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"


def test_a_session_ending_does_not_touch_anothers_memory(daemon: DaemonProcess, client: Client) -> None:
    kept = client.alloc(MiB)
    kept.write(b"k" * MiB)
    with Client(daemon.endpoint, timeout=10) as leaving:
        leaving.set_device(0)
        leaving.create_context()
        leaving.alloc(2 * MiB).fill(9)
    assert kept.read() == b"k" * MiB
    assert client.current_context() is not None


def test_closing_a_session_frees_its_memory(daemon: DaemonProcess, client: Client) -> None:
    baseline = [client.mem_get_info(device=d)[0] for d in (0, 1)]
    leaving = Client(daemon.endpoint, timeout=10)
    session_id = leaving.session_id
    leaving.alloc(3 * MiB, device=0)
    leaving.create_context(device=0)
    leaving.alloc(5 * MiB, device=0)
    leaving.create_context(device=1)
    leaving.alloc(7 * MiB, device=1)
    assert [client.mem_get_info(device=d)[0] for d in (0, 1)] == [baseline[0] - 8 * MiB, baseline[1] - 7 * MiB]
    assert sum(e["bytes"] for e in device_entries(client, session_id)) == 15 * MiB
    leaving.close()
    assert [client.mem_get_info(device=d)[0] for d in (0, 1)] == baseline
    assert device_entries(client, session_id) == []
    assert session_id not in [s["session"] for s in client.status()["sessions"]]


def test_closing_the_last_session_releases_the_primary_contexts(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, timeout=10) as first:
        first.set_device(0)
        first.set_device(1)
        with Client(daemon.endpoint, timeout=10) as second:
            second.set_device(1)
        status = first.status()
        assert [d["primary_context"]["active"] for d in status["devices"]] == [True, True]
    with Client(daemon.endpoint, timeout=10) as observer:
        status = observer.status()
        assert [d["primary_context"]["active"] for d in status["devices"]] == [False, False]
        assert [d["contexts"] for d in status["devices"]] == [[], []]
        assert [s["session"] for s in status["sessions"]] == [observer.session_id]


def test_many_sessions_come_and_go_without_leaks(daemon: DaemonProcess, client: Client) -> None:
    baseline = client.mem_get_info()[0]
    for n in range(20):
        with Client(daemon.endpoint, timeout=10) as short:
            short.alloc(MiB + n, device=n % 2)
            short.create_context(device=0)
            short.alloc(4096)
    assert client.mem_get_info()[0] == baseline
    assert client.mem_get_info(device=1)[0] == client.mem_get_info(device=1)[1]
    assert [s["session"] for s in client.status()["sessions"]] == [client.session_id]
