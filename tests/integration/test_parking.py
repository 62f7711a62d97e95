"""Persistent shares survive the daemon: parked in a service manager's fd store (tests/service_manager.py
stands in for systemd), the daemon SIGKILLed and started again with the stored fds."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from cuctxd import Client, SessionLost
from cuctxd.client.tensors import open_tensors, publish_tensors
from cuctxd.client.wire import build as requests
from cuctxd.protos.memfd import sealed_memfd
from tests.helpers import (
    DaemonProcess,
    start_daemon,
    wait_for_log,
    wait_until,
)
from tests.service_manager import ServiceManager, managed

SIM = ("--sim-devices", "1", "--sim-memory", "256MiB")
#: Above POOL_BUFFER_MAX: a legacy buffer when not shareable (on the sim, its own memfd), a VMM one when shareable.
BIG = 40 << 20
WEIGHTS = {"embed.weight": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
           "norm.bias": np.full(32, 0.5, dtype=np.float16)}


@functools.cache
def pattern(size: int, seed: int = 0) -> bytes:
    """:func:`tests.helpers.pattern`, made with numpy (tens of MiB here)."""
    return ((np.arange(size, dtype=np.uint64) * 7 + seed) % 251).astype(np.uint8).tobytes()


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    with managed() as service:
        yield service


def share_fdnames(manager: ServiceManager) -> list[str]:
    return [name for name in manager.names() if name.startswith("cuctxd-share-")]


def publish_three(endpoint: str) -> dict[str, str]:
    """A layout, a plain persistent pool buffer and a read-only persistent legacy one (plus a name that is not
    persistent); their share ids by name. The publishing session ends."""
    with Client(endpoint, name="producer") as c:
        layout = publish_tensors(c, "model", WEIGHTS, {"arch": "toy"})
        plain = c.alloc(1 << 20, shareable=True)
        c.write(plain, pattern(1 << 20))
        plain_share = c.run(requests.publish(plain, "plain", None, True, False))
        big = c.alloc(BIG)  # not shareable: legacy memory (shareable: VMM, test_a_vmm_share_survives_a_sigkill)
        c.write(big, pattern(BIG, 1))
        big_share = c.run(requests.publish(big, "big", None, True, True))
        assert big_share.mechanism == "ipc"
        passing = c.alloc(4096, shareable=True)
        c.publish(passing, "passing")
    return {"model": layout.share_id, "plain": plain_share.share_id, "big": big_share.share_id}


def test_layouts_plain_and_read_only_names_survive_a_sigkill(manager: ServiceManager) -> None:
    daemon = manager.start(*SIM)
    ids = publish_three(daemon.endpoint)
    assert len(share_fdnames(manager)) == 3  # the name that is not persistent is not parked
    old = Client(daemon.endpoint, name="old consumer")
    old_plain = old.open_shared("plain")
    old_big = old.open_shared("big")
    with Client(daemon.endpoint) as c:
        with_passing = c.mem_get_info()[0]
        c.unpublish("passing")  # nobody opened it: freed (on the device, after the reply)
        assert wait_until(lambda: c.mem_get_info()[0] > with_passing, 5)
        free_before = c.mem_get_info()[0]

    daemon = manager.restart(*SIM)
    ready = time.monotonic()
    with Client(daemon.endpoint) as c:
        listed = {s["name"]: s for s in c.list_shared()}
        assert time.monotonic() - ready < 1.0
        assert sorted(listed) == ["big", "model", "plain"]
        assert {name: listed[name]["share_id"] for name in ids} == ids
        assert listed["model"]["tensors"] == 2 and not listed["model"]["read_only"]
        assert listed["big"]["read_only"] and listed["big"]["size"] == BIG
        assert not any(s["owner_present"] for s in listed.values())
        assert listed["plain"]["publisher"]["client"] == "producer"
        assert c.mem_get_info()[0] == free_before  # the adopted memory counts against the device again

        with open_tensors(c, "model") as tensors:
            assert tensors.metadata == {"arch": "toy"}
            for name, array in WEIGHTS.items():
                assert np.array_equal(np.asarray(tensors[name]), array)
            assert {s["name"]: s["holders"] for s in c.list_shared()}["model"] == 1  # the new session holds it
        with c.open_shared("big") as big:
            assert big.descriptor.read_only
            assert bytes(big.host_view()) == pattern(BIG, 1)
        with c.open_shared("plain") as plain:
            assert bytes(plain.host_view()) == pattern(1 << 20)

        # the old consumer's mappings outlived its daemon; its session did not
        assert bytes(old_plain.host_view()) == pattern(1 << 20)
        assert bytes(old_big.host_view()[:4096]) == pattern(BIG, 1)[:4096]
        with pytest.raises(SessionLost):
            old.list_shared()

        for name in ("plain", "big", "model"):
            c.unpublish(name)
        assert wait_until_free(c, 256 << 20)
    assert share_fdnames(manager) == []
    assert {("remove", f"cuctxd-share-{share_id}") for share_id in ids.values()} <= set(manager.events)
    assert "adopted 3 parked share(s)" in daemon.log()
    old.close()


def test_a_vmm_share_survives_a_sigkill(manager: ServiceManager) -> None:
    """A shareable buffer above POOL_BUFFER_MAX is VMM memory: opened through its fd, parked by it, re-adopted by
    importing it; a mapping from before the kill still reads and writes the same memory as one made after."""
    daemon = manager.start(*SIM)
    with Client(daemon.endpoint, name="producer") as c:
        weights = c.alloc(BIG, shareable=True)
        c.write(weights, pattern(BIG, 2))
        share = c.run(requests.publish(weights, "vmm-weights", None, True, False))
        assert share.mechanism == "vmm" and share.allocation_size == BIG and share.ipc_handle == b""
        assert c.status()["devices"][0]["vmm"] == {"supported": True, "buffers": 1}
    assert share_fdnames(manager) == [f"cuctxd-share-{share.share_id}"]
    old = Client(daemon.endpoint, name="old consumer")
    old_mapping = old.open_shared("vmm-weights")
    assert old_mapping.descriptor.mechanism == "vmm"
    assert bytes(old_mapping.host_view()[-4096:]) == pattern(BIG, 2)[-4096:]
    with Client(daemon.endpoint) as c:
        free_before = c.mem_get_info()[0]

    daemon = manager.restart(*SIM)
    with Client(daemon.endpoint) as c:
        (listed,) = c.list_shared()
        assert listed["name"] == "vmm-weights" and listed["share_id"] == share.share_id and listed["size"] == BIG
        assert not listed["owner_present"]
        assert c.mem_get_info()[0] == free_before  # the adopted memory counts against the device again
        with c.open_shared("vmm-weights") as mapped:
            assert mapped.descriptor.mechanism == "vmm" and mapped.descriptor.allocation_size == BIG
            assert bytes(mapped.host_view()) == pattern(BIG, 2)
            mapped.host_view()[:5] = b"after"
            assert bytes(old_mapping.host_view()[:5]) == b"after"  # one memory: the old mapping sees the write
        c.unpublish("vmm-weights")
        assert wait_until_free(c, 256 << 20)
    assert share_fdnames(manager) == []
    assert ("remove", f"cuctxd-share-{share.share_id}") in manager.events
    assert "adopted 1 parked share(s)" in daemon.log() and "vmm" in daemon.log()
    old_mapping._mapping.close()  # its session died with the old daemon; the mapping is this process's own
    old.close()


def test_a_replaced_layout_is_parked_once_and_its_replacement_survives_a_sigkill(manager: ServiceManager) -> None:
    """``replace`` moves the name in one step: the old share (still held by a consumer) leaves the fd store,
    the new one is parked, and the next daemon adopts the new layout, its digest included."""
    daemon = manager.start(*SIM)
    renewed = {name: array + 1 for name, array in WEIGHTS.items()}
    with Client(daemon.endpoint, name="producer") as c:
        first = publish_tensors(c, "model", WEIGHTS)
    consumer = Client(daemon.endpoint, name="old consumer")
    held = open_tensors(consumer, "model")
    with Client(daemon.endpoint, name="producer, run again") as c:
        second = publish_tensors(c, "model", renewed, replace=True)
    assert share_fdnames(manager) == [f"cuctxd-share-{second.share_id}"]
    assert ("remove", f"cuctxd-share-{first.share_id}") in manager.events
    assert np.array_equal(np.asarray(held["embed.weight"]), WEIGHTS["embed.weight"])  # the holder keeps its bytes
    with Client(daemon.endpoint) as c, open_tensors(c, "model") as fresh:
        digest = fresh.digest
        assert digest is not None and np.array_equal(np.asarray(fresh["embed.weight"]), renewed["embed.weight"])

    daemon = manager.restart(*SIM)
    with Client(daemon.endpoint) as c:
        (listed,) = c.list_shared()
        assert listed["share_id"] == second.share_id and listed["digest"] == digest
        with open_tensors(c, "model", digest=digest) as adopted:
            assert np.array_equal(np.asarray(adopted["norm.bias"]), renewed["norm.bias"])
        c.unpublish("model")
    assert share_fdnames(manager) == []
    held.share._mapping.close()  # its session died with the old daemon; the mapping is this process's own
    consumer.close()


def wait_until_free(client: Client, total: int, timeout: float = 5.0) -> bool:
    """Whether the device's free memory reaches ``total`` (unpublish frees on the device after its reply)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.mem_get_info()[0] == total:
            return True
        time.sleep(0.02)
    return False


def test_a_graceful_stop_leaves_parked_shares_to_the_next_start(manager: ServiceManager) -> None:
    daemon = manager.start(*SIM)
    publish_three(daemon.endpoint)
    assert daemon.stop() == 0
    daemon = manager.start(*SIM, endpoint=daemon.endpoint)
    with Client(daemon.endpoint) as c:
        assert sorted(s["name"] for s in c.list_shared()) == ["big", "model", "plain"]
        with c.open_shared("big") as big:
            assert bytes(big.host_view()[-4096:]) == pattern(BIG, 1)[-4096:]


def test_hello_says_which_daemon_run_it_is(manager: ServiceManager) -> None:
    daemon = manager.start(*SIM)
    with Client(daemon.endpoint, reconnect=True) as c:
        first = c.instance
        assert first is not None and len(first) == 16 and not c.restarted
        manager.restart(*SIM)
        with pytest.raises(SessionLost):
            c.list_shared()
        assert c.list_shared() == []  # reconnect=True: the call after SessionLost opens a new session
        assert c.instance != first and c.restarted


def corrupt(kind: str, record: bytes) -> bytes:
    if kind == "newer format":
        return msgpack.packb({"format": 99, "generation": 1, "share": {}})
    if kind == "truncated":
        return record[:-10]
    return os.urandom(256)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "newer format"])
def test_a_bad_record_and_stray_fds_are_skipped_and_the_daemon_serves(manager: ServiceManager, kind: str) -> None:
    daemon = manager.start(*SIM)
    with Client(daemon.endpoint) as c:
        buffer = c.alloc(4096, shareable=True)
        c.run(requests.publish(buffer, "weights", None, True, False))
    manager.kill()
    (record,) = [name for name in manager.names() if name.startswith("cuctxd-record-")]
    (taken,) = manager.take(record)
    original = os.pread(taken, 1 << 20, 0)
    os.close(taken)
    raw = corrupt(kind, original)
    fd = sealed_memfd("test-record", len(raw))
    os.pwrite(fd, raw, 0)
    manager.add(record, fd)
    read_end, write_end = os.pipe()
    os.close(write_end)
    manager.add("cuctxd-share-" + "0" * 32, read_end)  # an fd without a record, of no memory at all
    manager.add("something-else", os.dup(read_end))

    daemon = manager.start(*SIM, endpoint=daemon.endpoint)
    with Client(daemon.endpoint) as c:
        assert c.list_shared() == []
        assert c.ping() > 0
        buffer = c.alloc(4096, shareable=True)
        c.run(requests.publish(buffer, "weights", None, True, False))  # the name is free again, and parks
    wait_for_log(daemon, "cannot be used")
    assert "dropping cuctxd-share-00000000" in daemon.log()
    assert "dropping something-else" in daemon.log()
    names = manager.names()
    assert len(share_fdnames(manager)) == 1
    assert record not in names and len([n for n in names if n.startswith("cuctxd-record-")]) == 1


def not_the_memory(kind: str) -> int:
    if kind == "pipe":
        read_end, write_end = os.pipe()
        os.close(write_end)
        return read_end
    return sealed_memfd("too-small", 4096)  # a memfd, but no block of 1 MiB in it, nor a VMM allocation


@pytest.mark.parametrize("kind,size,vmm", [("small memfd", 1 << 20, False), ("pipe", 1 << 20, False),
                                           ("small memfd", 1 << 20, True), ("small memfd", BIG, True),
                                           ("pipe", BIG, True)])
def test_a_registry_entry_whose_memory_does_not_match_is_skipped(manager: ServiceManager, kind: str,
                                                                 size: int, vmm: bool) -> None:
    """A VMM share (1 MiB: one granule; ``BIG``), or a pool share (1 MiB, on a sim without VMM), whose fd is not
    its memory is not adopted."""
    options = SIM if vmm else (*SIM, "--no-sim-vmm")
    daemon = manager.start(*options)
    with Client(daemon.endpoint) as c:
        for name in ("kept", "swapped"):
            buffer = c.alloc(size, shareable=True)
            c.write(buffer, pattern(size))
            c.run(requests.publish(buffer, name, None, True, False))
        swapped = c.lookup("swapped").share_id
        assert c.lookup("swapped").mechanism == ("vmm" if vmm else "pool")
    manager.kill()
    for fd in manager.take(f"cuctxd-share-{swapped}"):
        os.close(fd)
    manager.add(f"cuctxd-share-{swapped}", not_the_memory(kind))
    daemon = manager.start(*options, endpoint=daemon.endpoint)
    with Client(daemon.endpoint) as c:
        assert [s["name"] for s in c.list_shared()] == ["kept"]
    assert "not adopted" in daemon.log()
    assert f"cuctxd-share-{swapped}" not in manager.names()


def test_without_a_service_manager_the_daemon_says_a_restart_forgets(stop_after: list[DaemonProcess]) -> None:
    daemon = start_daemon(*SIM)
    stop_after.append(daemon)
    wait_for_log(daemon, "a restart forgets every published name")
