"""A hostile local process against the memory and fds the daemon shares with it: it resizes every memfd it was
given (an shm lane's region, a host buffer, a pool's fd) and then makes the daemon touch it, and it fills its
lane's reply eventfd so that a ring would block. The resizes fail with EPERM (the memfds are sealed), the lane
whose ring cannot be made is closed (never waited on), the daemon lives, the bystander is served, and the fds
go with the session."""

from __future__ import annotations

import errno
import mmap
import os
import select
import signal
import time
from collections.abc import Iterator

import pytest

from cuctxd import Client
from cuctxd.client.wire import build
from cuctxd.client.wire.fd_channel import FdChannel
from cuctxd.protos.memfd import resize_sealed
from cuctxd.protos.messages import encode_request
from cuctxd.protos.shm_lane import REGION_BYTES, REPLY_AT, REQUEST_AT, is_closed, read_message, write_message
from tests.adversarial.attacks import Bystander, assert_alive, open_bystander
from tests.adversarial.test_fd_channel import fd_count
from tests.helpers import DaemonProcess, freeze, pattern, remove_tempdir, start_daemon, wait_for_log, wait_until
from tests.helpers_raw import RawPeer, raw_peer

#: The largest value an eventfd's counter holds: one more ring would block (or fail, non-blocking).
EVENTFD_FULL = 0xFFFF_FFFF_FFFF_FFFE
_SIZE = 1 << 16


def _fetch(daemon: DaemonProcess, ticket: str) -> tuple[list[int], dict[str, object]]:
    channel = FdChannel(daemon.endpoint[len("ipc://"):] + ".fds", 10)
    try:
        return channel.fetch(ticket)
    finally:
        channel.close()


def _assert_cannot_resize(fd: int) -> None:
    """Neither shrinking, nor growing, nor a growing ``fallocate``: EPERM each time."""
    assert resize_sealed(fd)
    size = os.fstat(fd).st_size
    for attempt in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, size // 2),
                    lambda: os.ftruncate(fd, size * 2), lambda: os.posix_fallocate(fd, size, 4096)):
        with pytest.raises(OSError) as raised:
            attempt()
        assert raised.value.errno == errno.EPERM
    assert os.fstat(fd).st_size == size


@pytest.fixture
def attacker(attack_daemon: DaemonProcess, bystander: Bystander) -> Iterator[tuple[RawPeer, str]]:
    """A raw session (its requests hand-built on the main endpoint), made after the bystander (whose work
    started what device 0 keeps); its fds are checked gone after it."""
    with raw_peer(attack_daemon.endpoint) as peer:
        token = peer.hello()
        buffer = peer.ok("alloc", {"device": 0, "size": _SIZE}, token)[0]["buffer"]["handle"]
        peer.ok("read", {"device": 0, "buffer": buffer}, token)  # a large reply, sent zero-copy, starts pyzmq's gc
        peer.ok("free", {"device": 0, "buffer": buffer}, token)  # thread (its fds stay): before the count
        before = fd_count(attack_daemon)
        yield peer, token
        peer.ok("goodbye", None, token)
    assert wait_until(lambda: fd_count(attack_daemon) <= before, timeout=5), "the daemon kept fds of the attacker"


def test_a_lane_region_cannot_be_truncated_and_a_ring_after_trying_is_answered(
        attack_daemon: DaemonProcess, attacker: tuple[RawPeer, str], bystander: Bystander) -> None:
    peer, token = attacker
    result, _ = peer.ok("shm_lane", {"device": 0}, token)
    fds, _ = _fetch(attack_daemon, result["ticket"])
    memfd, ring, replies, _pidfd = fds
    try:
        _assert_cannot_resize(memfd)
        with mmap.mmap(memfd, REGION_BYTES) as region:
            write_message(memoryview(region), REQUEST_AT, 1, encode_request(1, "mem_get_info", token, {"device": 0}),
                          None)
            os.eventfd_write(ring, 1)
            poll = select.poll()
            poll.register(replies, select.POLLIN)
            assert poll.poll(5000), "no reply on the lane"
            seq, header, _ = read_message(memoryview(region), REPLY_AT)
            assert seq == 1 and b"total" in header
        bystander.check()
        assert_alive(attack_daemon)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_host_buffer_cannot_be_truncated_and_copies_from_it_still_work(
        attack_daemon: DaemonProcess, attacker: tuple[RawPeer, str], bystander: Bystander) -> None:
    peer, token = attacker
    buffer = peer.ok("alloc", {"device": 0, "size": _SIZE}, token)[0]["buffer"]["handle"]
    host = peer.ok("host_alloc", {"device": 0, "size": _SIZE}, token)[0]
    (memfd,), _ = _fetch(attack_daemon, host["ticket"])
    try:
        _assert_cannot_resize(memfd)
        data = pattern(_SIZE, seed=5)
        with mmap.mmap(memfd, _SIZE) as mapped:
            mapped[:] = data
        result, _ = peer.ok("memcpy_htod", {"device": 0, "buffer": buffer, "host": host["host"]}, token)
        assert result == {"size": _SIZE}
        assert peer.ok("read", {"device": 0, "buffer": buffer}, token)[1] == [data]
        bystander.check()
        assert_alive(attack_daemon)
    finally:
        os.close(memfd)


@pytest.mark.parametrize(("attack_daemon_args", "mechanism"), [((), "vmm"), (("--no-sim-vmm",), "pool")])
def test_a_shared_buffers_fd_cannot_be_truncated_and_the_buffer_still_takes_writes(
        attack_daemon: DaemonProcess, attacker: tuple[RawPeer, str], bystander: Bystander, mechanism: str) -> None:
    """The fd of a VMM allocation (the sim's memfd), or of a pool of its own on a device without VMM."""
    peer, token = attacker
    buffer = peer.ok("alloc", {"device": 0, "size": 256, "shareable": True}, token)[0]["buffer"]["handle"]
    share = peer.ok("export", {"device": 0, "buffer": buffer}, token)[0]["share"]
    assert share["mechanism"] == mechanism
    opened = peer.ok("open_shared", {"device": 0, "share_id": share["share_id"], "pool_fd": True}, token)[0]
    (pool,), _ = _fetch(attack_daemon, opened["ticket"])
    try:
        _assert_cannot_resize(pool)
        for _ in range(3):  # the daemon writes into the pool's memory each time
            peer.ok("write", {"device": 0, "buffer": buffer}, token, [b"w" * 256])
            assert peer.ok("read", {"device": 0, "buffer": buffer}, token)[1] == [b"w" * 256]
        bystander.check()
        assert_alive(attack_daemon)
        peer.ok("close_shared", {"device": 0, "share_id": share["share_id"]}, token)
    finally:
        os.close(pool)


def test_a_full_reply_eventfd_closes_the_lane_and_never_blocks_the_worker() -> None:
    daemon = start_daemon("--sim-devices", "2", "--sim-memory", "256MiB")
    try:
        with open_bystander(daemon.endpoint) as bystander, raw_peer(daemon.endpoint) as peer:
            token = peer.hello()
            result, _ = peer.ok("shm_lane", {"device": 0}, token)
            fds, _ = _fetch(daemon, result["ticket"])
            memfd, ring, replies, _pidfd = fds
            os.eventfd_write(replies, EVENTFD_FULL)
            with mmap.mmap(memfd, REGION_BYTES) as region, memoryview(region) as view:
                write_message(view, REQUEST_AT, 1, encode_request(1, "mem_get_info", token, {"device": 0}), None)
                os.eventfd_write(ring, 1)
                wait_for_log(daemon, "its shm lane closed: the client filled the reply eventfd")
                assert wait_until(lambda: is_closed(view), 5.0)
                seq, _, payload = read_message(view, REPLY_AT)
                assert seq == 1 and payload is None  # answered, but not rung
            bystander.check()  # device 0's worker is not stuck
            assert peer.ok("mem_get_info", {"device": 0}, token)[0]["total"] > 0  # the session goes on, by socket
            assert peer.ok("status", None, token)[0]["devices"][0]["shm_lanes"] == 1  # the bystander's only
            assert_alive(daemon)
            for fd in fds:
                os.close(fd)
        started = time.monotonic()
        assert daemon.stop(timeout=10) == 0, daemon.log()[-3000:]
        assert time.monotonic() - started < 5, "SIGTERM took long: a worker was blocked"
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()
        remove_tempdir(daemon.socket_dir)


def test_the_python_client_takes_the_socket_once_its_lane_is_closed(attack_daemon: DaemonProcess,
                                                                     bystander: Bystander) -> None:
    with Client(attack_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(64, device=0)  # opens the client's lane
        lane = client._router.shm.for_device(0) if client._router.shm is not None else None
        assert lane is not None
        request = build.mem_get_info(0)
        freeze(attack_daemon.process.pid)  # so that the counter is full before the daemon rings
        try:
            call = lane.try_send(request.op, request.args, client._token, into=request.into, convert=request.convert)
            os.eventfd_write(lane._replies, EVENTFD_FULL)
        finally:
            os.kill(attack_daemon.process.pid, signal.SIGCONT)
        wait_for_log(attack_daemon, "its shm lane closed")
        assert call is not None and call.result()[1] > 0  # answered in the region, though never rung
        for _ in range(3):  # on the socket now
            assert client.mem_get_info(0)[1] > 0
            client.write(buffer, b"b" * 64)
            assert client.read(buffer) == b"b" * 64
        assert not lane.usable
    bystander.check()
