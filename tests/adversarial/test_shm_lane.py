"""A hostile local process on its own shm lane: garbage lengths, another session's token, rings without a
request, a flood of rings, a second lane, early requests whose data ring comes late, never, or at once.
Each runs against a real daemon process; the bystander (a session using its own lane) must not notice,
and the lane's fds go when the session ends."""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from cuctxd import BadRequest, Client
from cuctxd.client.wire import build
from cuctxd.client.wire.fd_channel import FdChannel
from cuctxd.protos.messages import encode_request, parse_reply
from cuctxd.protos.shm_lane import (
    CLOSED_AT,
    EARLY_AT,
    MESSAGE_HEAD,
    REGION_BYTES,
    REPLY_AT,
    REQUEST_AT,
    mark_early,
    read_message,
    write_message,
)
from tests.adversarial.attacks import Bystander, assert_alive, attacked_daemon
from tests.adversarial.test_fd_channel import fd_count
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon, wait_for_log, wait_until


@dataclass
class RawLane:
    """A lane opened by hand: the session's raw client (on the main endpoint only) and the three fds."""

    client: Client
    region: mmap.mmap
    requests: int
    replies: int

    def ring(self) -> None:
        os.eventfd_write(self.requests, 1)

    def reply(self, timeout: float = 5.0) -> tuple[int, dict[str, object]] | None:
        """``(seq, reply header)`` once the daemon answered, or None after ``timeout`` s."""
        poll = select.poll()
        poll.register(self.replies, select.POLLIN)
        if not poll.poll(int(timeout * 1000)):
            return None
        os.eventfd_read(self.replies)
        seq, header, _ = read_message(memoryview(self.region), REPLY_AT)
        return seq, msgpack.unpackb(header)

    def close(self) -> None:
        self.region.close()
        os.close(self.requests)
        os.close(self.replies)


def open_raw_lane(daemon: DaemonProcess, client: Client) -> RawLane:
    """The session's lane to device 0, opened by hand (``client`` has ``device_endpoints=False``, so it
    opens no lane of its own)."""
    ticket = client.run(build.shm_lane(0))["ticket"]
    channel = FdChannel(daemon.endpoint[len("ipc://"):] + ".fds", 10)
    fds, info = channel.fetch(ticket)
    channel.close()
    assert info == {"shm_lane": 0} and len(fds) == 4  # the region, two eventfds, the daemon's pidfd
    region = mmap.mmap(fds[0], REGION_BYTES)
    os.close(fds[0])
    os.close(fds[3])
    return RawLane(client, region, fds[1], fds[2])


@pytest.fixture(scope="module")
def attack_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the module's attacks: each is made on a session (and lane) of its own, which it ends, and
    what a test compares (fd counts) it reads before and after; the daemon must be alive after each (``raw_lane``'s
    and the ``bystander``'s checks) and exit 0 with a clean log after the last."""
    with attacked_daemon() as process:
        yield process


@pytest.fixture
def raw_lane(attack_daemon: DaemonProcess) -> Iterator[RawLane]:
    with Client(attack_daemon.endpoint, timeout=10, device_endpoints=False) as client:
        lane = open_raw_lane(attack_daemon, client)
        yield lane
        lane.close()
    assert_alive(attack_daemon)


def _request(lane: RawLane, seq: int, op: str, args: dict[str, object], token: str | None = None,
             early: bool = False) -> None:
    header = encode_request(seq, op, lane.client._token if token is None else token, args)
    write_message(memoryview(lane.region), REQUEST_AT, seq, header, None)
    if early:
        mark_early(memoryview(lane.region), seq)
    lane.ring()


_EARLY_BYTES = 1 << 16


@pytest.fixture
def early_copy(raw_lane: RawLane) -> Iterator[tuple[Any, Any]]:
    """A device buffer and a host buffer of :data:`_EARLY_BYTES` in the raw lane's session."""
    buffer = raw_lane.client.alloc(_EARLY_BYTES, 0)
    host = raw_lane.client.host_alloc(_EARLY_BYTES, device=0)
    yield buffer, host
    host.free()


def _htod(buffer: Any, host: Any) -> dict[str, object]:
    return {"device": 0, "buffer": buffer.handle, "host": host.handle}


def test_an_early_copy_waits_for_its_data_ring_and_copies_what_is_there_then(
        raw_lane: RawLane, early_copy: tuple[Any, Any], bystander: Bystander) -> None:
    buffer, host = early_copy
    host[:] = b"a" * _EARLY_BYTES
    _request(raw_lane, 1, "memcpy_htod", _htod(buffer, host), early=True)
    assert raw_lane.reply(timeout=0.5) is None  # checked, parked: no reply before the data ring
    bystander.check()  # the device goes on for everyone else meanwhile
    host[:] = b"b" * _EARLY_BYTES
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 1 and answer[1]["result"] == {"size": _EARLY_BYTES}
    assert buffer.read() == b"b" * _EARLY_BYTES


def test_a_data_ring_that_came_with_the_request_counts(raw_lane: RawLane, early_copy: tuple[Any, Any]) -> None:
    buffer, host = early_copy
    host[:] = b"c" * _EARLY_BYTES
    _request(raw_lane, 1, "memcpy_htod", _htod(buffer, host), early=True)
    raw_lane.ring()  # at once: the daemon may read both rings as one count
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 1 and "error" not in answer[1]
    assert buffer.read() == b"c" * _EARLY_BYTES


def test_an_early_requests_error_waits_for_the_data_ring_which_then_cannot_meet_the_next_request(
        raw_lane: RawLane, early_copy: tuple[Any, Any], bystander: Bystander) -> None:
    buffer, host = early_copy
    _request(raw_lane, 1, "memcpy_htod", {**_htod(buffer, host), "buffer": 999_999}, early=True)
    assert raw_lane.reply(timeout=0.5) is None  # answered already, rung only after the data ring
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 1
    assert answer[1]["error"]["name"] == "CUCTXD_ERROR_UNKNOWN_HANDLE"  # type: ignore[index]
    host[:] = b"d" * _EARLY_BYTES
    _request(raw_lane, 2, "memcpy_htod", _htod(buffer, host), early=True)
    assert raw_lane.reply(timeout=0.5) is None  # the ring owed for request 1 was not taken for this one
    host[:] = b"e" * _EARLY_BYTES
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 2 and "error" not in answer[1]
    assert buffer.read() == b"e" * _EARLY_BYTES
    bystander.check()


def test_an_early_copy_whose_host_buffer_went_meanwhile_is_an_error(
        raw_lane: RawLane, early_copy: tuple[Any, Any], bystander: Bystander) -> None:
    buffer, host = early_copy
    _request(raw_lane, 1, "memcpy_htod", _htod(buffer, host), early=True)
    assert raw_lane.reply(timeout=0.3) is None
    host.free()  # on the socket, breaking the lane's order
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[1]["error"]["name"] == "CUCTXD_ERROR_UNKNOWN_HANDLE"  # type: ignore[index]
    bystander.check()


def test_a_drain_waits_for_a_parked_early_copy_and_answers_it() -> None:
    daemon = start_daemon("--drain-timeout", "20")
    try:
        client = Client(daemon.endpoint, timeout=10, device_endpoints=False)
        lane = open_raw_lane(daemon, client)
        buffer = client.alloc(_EARLY_BYTES, 0)
        host = client.host_alloc(_EARLY_BYTES, device=0)
        _request(lane, 1, "memcpy_htod", _htod(buffer, host), early=True)
        assert lane.reply(timeout=0.3) is None
        daemon.process.send_signal(signal.SIGTERM)
        wait_for_log(daemon, "draining: ")
        assert daemon.process.poll() is None  # the parked copy counts as work not answered yet
        host[:] = b"f" * _EARLY_BYTES
        lane.ring()
        answer = lane.reply()
        assert answer is not None and answer[0] == 1 and answer[1]["result"] == {"size": _EARLY_BYTES}
        assert daemon.process.wait(20) == 0
        assert "drained in" in daemon.log()
        lane.close()
        client.close()  # its goodbye finds no daemon, and says nothing
    finally:
        daemon.stop()
        remove_tempdir(daemon.socket_dir)


def test_a_session_that_never_rings_its_data_ring_ends_cleanly(attack_daemon: DaemonProcess,
                                                               bystander: Bystander) -> None:
    before = fd_count(attack_daemon)
    with Client(attack_daemon.endpoint, timeout=10, device_endpoints=False) as client:
        lane = open_raw_lane(attack_daemon, client)
        buffer = client.alloc(_EARLY_BYTES, 0)
        host = client.host_alloc(_EARLY_BYTES, device=0)
        _request(lane, 1, "memcpy_htod", _htod(buffer, host), early=True)
        bystander.check()
        host.close()
        lane.close()
    assert wait_until(lambda: fd_count(attack_daemon) <= before, timeout=5)
    bystander.check()


def test_a_raw_lane_answers_requests_in_its_region(raw_lane: RawLane, bystander: Bystander) -> None:
    _request(raw_lane, 1, "mem_get_info", {"device": 0})
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 1
    reply = parse_reply(msgpack.packb(answer[1]))
    assert reply.error is None and reply.result["total"] > 0
    bystander.check()


def test_lengths_that_do_not_fit_are_answered_with_bad_request(raw_lane: RawLane, bystander: Bystander) -> None:
    MESSAGE_HEAD.pack_into(raw_lane.region, REQUEST_AT, 1, 1 << 30, 1, 1 << 30)
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 1
    assert answer[1]["error"]["name"] == "CUCTXD_ERROR_BAD_REQUEST"  # type: ignore[index]
    _request(raw_lane, 2, "mem_get_info", {"device": 0})  # the lane still works
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 2 and "error" not in answer[1]
    bystander.check()


def test_garbage_headers_and_another_sessions_token_are_refused(raw_lane: RawLane, bystander: Bystander) -> None:
    write_message(memoryview(raw_lane.region), REQUEST_AT, 1, b"\xc1 not msgpack", None)
    raw_lane.ring()
    answer = raw_lane.reply()
    assert answer is not None and answer[1]["error"]["name"] == "CUCTXD_ERROR_BAD_REQUEST"  # type: ignore[index]
    other = bystander.client._token
    assert other is not None
    _request(raw_lane, 2, "mem_get_info", {"device": 0}, token=other)
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 2
    assert "session the lane was opened for" in answer[1]["error"]["message"]  # type: ignore[index]
    bystander.check()


def test_rings_without_a_new_request_are_ignored_and_a_flood_costs_nothing(raw_lane: RawLane,
                                                                           bystander: Bystander) -> None:
    _request(raw_lane, 1, "mem_get_info", {"device": 0})
    assert raw_lane.reply() is not None
    raw_lane.ring()  # the same sequence number again
    assert raw_lane.reply(timeout=0.5) is None
    for ring in range(10_000):
        raw_lane.ring()
        if ring % 2500 == 0:
            bystander.check()
    assert raw_lane.reply(timeout=0.5) is None
    _request(raw_lane, 2, "mem_get_info", {"device": 0})
    answer = raw_lane.reply()
    assert answer is not None and answer[0] == 2


def test_a_second_lane_is_refused(raw_lane: RawLane) -> None:
    with pytest.raises(BadRequest, match="already has an shm lane"):
        raw_lane.client.run(build.shm_lane(0))


def test_the_lanes_fds_go_with_the_session(attack_daemon: DaemonProcess) -> None:
    before = fd_count(attack_daemon)
    with Client(attack_daemon.endpoint, timeout=10) as client:
        client.alloc(64).free()  # the first device op opens the client's lane
        assert client.status()["devices"][0]["shm_lanes"] == 1
        assert fd_count(attack_daemon) > before
    assert wait_until(lambda: fd_count(attack_daemon) <= before, timeout=5)


def test_a_reply_too_large_for_the_area_is_an_error_not_a_crash(raw_lane: RawLane, bystander: Bystander) -> None:
    buffer = raw_lane.client.alloc(1 << 20, 0)
    _request(raw_lane, 1, "read", {"device": 0, "buffer": buffer.handle, "size": 1 << 20})
    answer = raw_lane.reply()
    assert answer is not None and answer[1]["error"]["name"] == "CUCTXD_ERROR_TOO_LARGE"  # type: ignore[index]
    bystander.check()


def test_head_layout_is_what_the_spec_says() -> None:
    assert MESSAGE_HEAD.size == 20 and struct.calcsize("<QIII") == 20
    assert (REPLY_AT, CLOSED_AT, EARLY_AT, REGION_BYTES) == (65536, 131072, 131080, 131136)
