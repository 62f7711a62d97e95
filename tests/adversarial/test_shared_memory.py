"""A hostile local process against the memory the daemon shares with it: it resizes every memfd it was given
(an shm lane's region, a host buffer, a pool's fd) and then makes the daemon touch it. The resizes fail with
EPERM (the memfds are sealed), the daemon lives, the bystander is served, and the fds go with the session."""

from __future__ import annotations

import errno
import mmap
import os
import select
from collections.abc import Iterator

import pytest

from cuctxd.client.fd_channel import FdChannel
from cuctxd.protos.memfd import resize_sealed
from cuctxd.protos.messages import encode_request
from cuctxd.protos.shm_lane import REGION_BYTES, REPLY_AT, REQUEST_AT, read_message, write_message
from tests.adversarial.attacks import Bystander, assert_alive
from tests.adversarial.test_fd_channel import fd_count
from tests.helpers import DaemonProcess, pattern, wait_until
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
    memfd, ring, replies = fds
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


def test_a_pool_fd_cannot_be_truncated_and_the_pools_buffers_still_take_writes(
        attack_daemon: DaemonProcess, attacker: tuple[RawPeer, str], bystander: Bystander) -> None:
    peer, token = attacker
    buffer = peer.ok("alloc", {"device": 0, "size": 256}, token)[0]["buffer"]["handle"]
    share = peer.ok("export", {"device": 0, "buffer": buffer}, token)[0]["share"]
    assert share["mechanism"] == "pool"
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
