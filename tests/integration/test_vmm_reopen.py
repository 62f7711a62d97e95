"""Opening a VMM share again in a process that maps it already (PROTOCOL.md, section 9, "VMM shares"): the
process's one mapping is reused, with no fd and no import, for every opening and client in the process, and
unmapped with the last opening; the daemon still counts each hold. A sim daemon, real sockets, the real client,
this test's own process as the one that maps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cuctxd.client import Client, NotFound, OpenedShare, Revoked
from tests.helpers import DaemonProcess, pattern


def address(share: OpenedShare) -> int:
    """Where this process maps the share's bytes."""
    return int(np.frombuffer(share.host_view(), np.uint8).ctypes.data)


def mapped_here(start: int) -> bool:
    """Whether this process maps a shared memfd at ``start`` (a line of ``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(end, 16) for end in line.split()[0].split("-"))
            if low <= start < high:
                return "/memfd:" in line
    return False


def fds_received(client: Client) -> int:
    """The fds ``client``'s fd channel has received: the first request for a device brings its shm lane's too, so
    compare counts taken after the client has used the device."""
    plane = client.data_plane()
    assert plane is not None
    return plane.channel.fds_received


def holds_of(client: Client, session_id: int) -> int:
    return int(next(s for s in client.status()["devices"][0]["sessions"] if s["session"] == session_id)["holds"])


def holders(client: Client, share_id: str) -> list[int]:
    share = next(s for s in client.status()["devices"][0]["shares"] if share_id.startswith(s["share_id"]))
    return list(share["holders"])


def test_a_second_open_in_the_process_reuses_the_mapping_and_receives_no_fd(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as consumer, Client(daemon.endpoint) as other:
        buf = owner.alloc(8192, shareable=True)
        buf.write(pattern(8192))
        descriptor = owner.publish(buf, "reopen-shared")
        assert descriptor.mechanism == "vmm"
        for client in (consumer, other):
            client.open_shared(descriptor).close()
        before, other_before = fds_received(consumer), fds_received(other)
        first = consumer.open_shared("reopen-shared")
        received = fds_received(consumer)
        assert received == before + 1
        by_name, by_descriptor = consumer.open_shared("reopen-shared"), consumer.open_shared(descriptor)
        from_another_session = other.open_shared("reopen-shared")
        assert fds_received(consumer) == received and fds_received(other) == other_before
        assert {address(s) for s in (by_name, by_descriptor, from_another_session)} == {address(first)}
        assert by_name.read() == pattern(8192)
        by_descriptor.write(b"back")
        assert first.read(4) == b"back" and buf.read(4) == b"back"
        assert holders(owner, descriptor.share_id) == sorted([consumer.session_id, other.session_id])
        assert holds_of(owner, consumer.session_id) == 3  # the daemon counts every opening's hold
        for share in (first, by_name, by_descriptor, from_another_session):
            share.close()
        owner.unpublish("reopen-shared")


def test_closing_one_of_two_openings_keeps_the_other_and_the_last_close_unmaps(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as consumer:
        buf = owner.alloc(8192, shareable=True)
        buf.write(pattern(8192, seed=3))
        descriptor = owner.export(buf)
        consumer.open_shared(descriptor).close()
        before = fds_received(consumer)
        first, second = consumer.open_shared(descriptor), consumer.open_shared(descriptor)
        start = address(first)
        assert mapped_here(start) and fds_received(consumer) == before + 1
        first.close()
        assert mapped_here(start) and second.read() == pattern(8192, seed=3)
        second.write(b"still")
        assert buf.read(5) == b"still"
        second.close()
        assert not mapped_here(start)
        third = consumer.open_shared(descriptor)  # nothing closed is kept: a new import, from a new fd
        assert fds_received(consumer) == before + 2 and third.read(5) == b"still"
        third.close()


def test_the_share_is_freed_once_the_last_opening_closes_after_its_owner_freed_it(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as consumer:
        allocated = owner.status()["devices"][0]["memory"]["allocated"]
        buf = owner.alloc(8192, shareable=True)
        descriptor = owner.publish(buf, "reopen-freed")
        first, second = consumer.open_shared("reopen-freed"), consumer.open_shared("reopen-freed")
        start = address(first)
        owner.free(buf)  # unpublishes; the holds keep the memory
        first.close()
        assert holders(owner, descriptor.share_id) == [consumer.session_id]
        assert owner.status()["devices"][0]["memory"]["allocated"] > allocated and mapped_here(start)
        second.close()
        assert owner.status()["devices"][0]["memory"]["allocated"] == allocated and not mapped_here(start)
        with pytest.raises(NotFound):
            consumer.open_shared(descriptor)


def test_two_shares_never_share_a_mapping(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as consumer:
        bufs = [owner.alloc(8192, shareable=True) for _ in range(2)]
        for seed, buf in enumerate(bufs):
            buf.write(pattern(8192, seed=seed))
        descriptors = [owner.export(buf) for buf in bufs]
        opened = [consumer.open_shared(d) for d in descriptors + descriptors]
        assert address(opened[0]) != address(opened[1])
        assert [address(s) for s in opened[2:]] == [address(s) for s in opened[:2]]
        assert [s.read() for s in opened] == [pattern(8192, seed=0), pattern(8192, seed=1)] * 2
        for share in opened:
            share.close()


def test_an_open_the_daemon_refuses_gives_its_reference_on_the_mapping_back(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as holder, Client(daemon.endpoint) as late:
        buf = owner.alloc(8192, shareable=True)
        descriptor = owner.export(buf)
        held = holder.open_shared(descriptor)
        start = address(held)
        owner.revoke(buf)
        with pytest.raises(Revoked):
            late.open_shared(descriptor)
        with pytest.raises(Revoked):  # its hold went with the revoke; the mapping goes with its close
            held.close()
        assert not mapped_here(start)


def test_clients_opening_one_share_at_once_end_up_with_one_mapping(daemon: DaemonProcess) -> None:
    """Threads racing to map the same share each may import it; one mapping is kept, the others are undone."""
    with Client(daemon.endpoint) as owner:
        buf = owner.alloc(8192, shareable=True)
        buf.write(pattern(8192, seed=5))
        descriptor = owner.export(buf)
        clients = [Client(daemon.endpoint) for _ in range(6)]
        try:
            start = threading.Barrier(len(clients))

            def open_at_once(client: Client) -> OpenedShare:
                start.wait(timeout=30)
                return client.open_shared(descriptor)

            with ThreadPoolExecutor(len(clients)) as pool:
                opened = list(pool.map(open_at_once, clients))
            assert len({address(share) for share in opened}) == 1
            assert all(share.read() == pattern(8192, seed=5) for share in opened)
            last = opened.pop()
            for share in opened:
                share.close()
            start_address = address(last)
            assert mapped_here(start_address)
            last.close()
            assert not mapped_here(start_address)
        finally:
            for client in clients:
                client.close()
