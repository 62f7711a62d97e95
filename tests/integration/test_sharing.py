"""Sharing between real processes through a real daemon: publish, open, refcounts, deferred free."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from cuctxd.client import BadArgument, Client, NameExists, NotFound, NotShareable, OutOfRange, UnknownHandle
from tests.helpers import REPO, DaemonProcess, client_env, run_client, wait_until
from tests.helpers_raw import raw_peer

PATTERN = bytes(range(256)) * 16  # 4 KiB


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "64MiB")


def device_totals(c: Client) -> list[tuple[int, int, int]]:
    """(allocations, bytes, shares) per device, all sessions but this one's none."""
    return [
        (sum(s["allocations"] for s in dev["sessions"]), sum(s["bytes"] for s in dev["sessions"]),
         len(dev["shares"]))
        for dev in c.status()["devices"]
    ]


PRODUCER = """
from cuctxd.client import Client
with Client(ENDPOINT) as c:
    buf = c.alloc(4096, device=1, shareable=True)
    buf.write(bytes(range(256)) * 16)
    c.publish(buf, "weights")
    print("published")
"""

CONSUMER = """
from cuctxd.client import Client
with Client(ENDPOINT) as c:
    with c.open_shared("weights") as shared:
        print(shared.device, shared.size, bytes(shared.host_view()).hex())
"""


def test_published_buffer_outlives_its_producer_and_serves_every_consumer_until_unpublished(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        free_before = observer.mem_get_info(1)[0]
        assert "published" in run_client(PRODUCER, daemon.endpoint)
        listed = observer.list_shared()
        assert [(s["name"], s["device"], s["size"], s["owner_present"]) for s in listed] == [
            ("weights", 1, 4096, False)
        ]
        for _ in range(2):  # one consumer after the other: the name is not consumed
            device, size, data = run_client(CONSUMER, daemon.endpoint).split()
            assert (int(device), int(size), bytes.fromhex(data)) == (1, 4096, PATTERN)
        assert [s["name"] for s in observer.list_shared()] == ["weights"]
        assert device_totals(observer)[1] == (0, 0, 1)
        observer.unpublish("weights")  # the publisher's user (this test's) may, the publisher being gone
        assert wait_until(lambda: device_totals(observer)[1] == (0, 0, 0), timeout=5)
        assert observer.list_shared() == []
        assert observer.mem_get_info(1)[0] == free_before


def test_a_name_published_once_is_freed_after_its_first_consumer(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        run_client(PRODUCER.replace('c.publish(buf, "weights")', 'c.publish(buf, "weights", once=True)'),
                   daemon.endpoint)
        assert bytes.fromhex(run_client(CONSUMER, daemon.endpoint).split()[2]) == PATTERN
        assert observer.list_shared() == []
        assert device_totals(observer)[1] == (0, 0, 0)
        with pytest.raises(BadArgument, match="cannot be persistent"):
            observer.publish(observer.alloc(64, shareable=True), "both", once=True, persistent=True)


def test_owner_free_is_deferred_while_another_session_holds_the_buffer(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as holder:
        buf = owner.alloc(4096, shareable=True)
        buf.write(PATTERN)
        descriptor = buf.export()
        shared = holder.open_shared(descriptor)
        buf.free()
        assert bytes(shared.host_view()) == PATTERN  # not yanked from under the holder
        shares = owner.status()["devices"][0]["shares"]
        assert [(s["owner_present"], s["holders"]) for s in shares] == [(False, [holder.session_id])]
        shared.close()
        assert device_totals(owner)[0] == (0, 0, 0)
        with pytest.raises(NotFound):
            holder.open_shared(descriptor)


def test_writes_through_a_mapping_are_seen_by_the_owner(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner:
        buf = owner.alloc(1024, shareable=True)
        buf.fill(0)
        out = run_client(f"""
from cuctxd.client import Client
from cuctxd.protos.records import ShareDescriptor
import pickle
desc = pickle.loads({pickle.dumps(buf.export())!r})
with Client(ENDPOINT) as c, c.open_shared(desc) as shared:
    shared.host_view()[10:13] = b"abc"
    print("wrote")
""", daemon.endpoint)
        assert "wrote" in out
        assert buf.read(3, offset=10) == b"abc"


def test_descriptor_is_plain_picklable_data(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        descriptor = c.alloc(512, shareable=True).export()
        assert pickle.loads(pickle.dumps(descriptor)) == descriptor
        assert descriptor.mechanism == "vmm" and descriptor.allocation_size == 2 << 20
        assert descriptor.backend == "sim"
        assert descriptor.size == 512


def test_a_name_belongs_to_its_publishers_user(daemon: DaemonProcess) -> None:
    """The NameExists message says who may unpublish, and that is who can: another session of the same uid
    (a producer run again), while the first one still runs too."""
    with Client(daemon.endpoint) as a, Client(daemon.endpoint) as b:
        buf = a.alloc(256, shareable=True)
        a.publish(buf, "model")
        with pytest.raises(NameExists, match=rf"a session of uid {os.getuid()} .* may unpublish it first "
                                             r"\(cuctx unpublish model\)"):
            b.publish(b.alloc(256, shareable=True), "model")
        assert b.lookup("model").size == 256
        b.unpublish("model")
        with pytest.raises(NotFound):
            b.lookup("model")
        with pytest.raises(NotFound):
            a.unpublish("model")
        assert buf.read(4) == bytes(4)  # the owner keeps its buffer: only the name went


def test_explicit_free_unpublishes(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as a:
        buf = a.alloc(256, shareable=True)
        a.publish(buf, "ephemeral")
        buf.free()
        with pytest.raises(NotFound):
            a.lookup("ephemeral")
        assert device_totals(a)[0] == (0, 0, 0)


def test_a_session_cannot_touch_another_sessions_private_buffers(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as a, Client(daemon.endpoint) as b:
        buf = a.alloc(256)
        stolen = type(buf)(b, buf.record)
        for attempt in (stolen.read, stolen.export, stolen.free, lambda: stolen.publish("x")):
            with pytest.raises(UnknownHandle):
                attempt()
        assert buf.read(4) == b"\0\0\0\0"


def test_bogus_and_stale_descriptors_are_refused_clearly(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        descriptor = c.alloc(256, shareable=True).export()
        with pytest.raises(NotFound) as bogus:
            c.open_shared(dataclasses.replace(descriptor, share_id="0" * 32))
        assert bogus.value.name == "CUCTXD_ERROR_NOT_FOUND"
        with pytest.raises(NotShareable) as elsewhere:
            c.open_shared(dataclasses.replace(descriptor, host="another-host/boot"))
        assert "same host" in elsewhere.value.message
        with pytest.raises(NotFound):
            c.close_shared(descriptor)  # never opened by this session
    with Client(daemon.endpoint) as later, pytest.raises(NotFound):
        later.open_shared(descriptor)  # its owner's session ended: the buffer is gone


def test_cuctx_shared_lists_published_buffers(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        c.publish(c.alloc(2048, shareable=True), "listed")
        out = subprocess.run([sys.executable, "-m", "cuctxd.client", "--endpoint", daemon.endpoint, "shared"],
                             capture_output=True, text=True, env=client_env(), cwd=REPO, check=True).stdout
        assert "listed" in out and "2 KiB" in out
        c.unpublish("listed")


def test_list_shared_pages_through_every_name_and_filters_by_prefix_owner_and_uid(daemon: DaemonProcess) -> None:
    """2,500 names: a page holds at most ``limit`` (1000 at most) and says where the next starts; the client's
    list_shared and ``cuctx shared`` go through every page."""
    with raw_peer(daemon.endpoint) as peer, Client(daemon.endpoint, name="lister") as c:
        hello = peer.ok("hello", {"protocol": 1, "client": "crowd", "pid": 1})[0]
        token = hello["session"]
        handle = peer.ok("alloc", {"size": 4096, "device": 0, "shareable": True}, token)[0]["buffer"]["handle"]
        names = [f"{'ab'[n % 2]}-{n:05d}" for n in range(2500)]
        for start in range(0, len(names), 250):
            ids = [peer.send("publish", {"buffer": handle, "name": name, "device": 0}, token)
                   for name in names[start:start + 250]]
            assert all(peer.recv()[0]["ok"] for _ in ids)
        c.publish(c.alloc(64, 0, shareable=True), "b-mine")
        everything = sorted([*names, "b-mine"])
        assert [s["name"] for s in c.list_shared()] == everything
        first = c.shared_page()
        assert [s["name"] for s in first.shared] == everything[:1000] and first.next == everything[999]
        assert first.count == 2501
        second = c.shared_page(limit=3, after=first.next)
        assert [s["name"] for s in second.shared] == everything[1000:1003] and second.next == everything[1002]
        last = c.shared_page(limit=5, prefix="b-", after="b-02495")
        assert [s["name"] for s in last.shared] == ["b-02497", "b-02499", "b-mine"] and last.next is None
        assert [s["name"] for s in c.list_shared(prefix="a-")] == names[0::2]
        assert [s["name"] for s in c.list_shared(owner=c.session_id)] == ["b-mine"]
        assert [s["name"] for s in c.list_shared(prefix="b-", owner=hello["session_id"])] == names[1::2]
        assert len(c.list_shared(uid=os.getuid())) == 2501 and c.list_shared(uid=os.getuid() + 1) == []
        with pytest.raises(BadArgument, match="limit"):
            c.shared_page(limit=1001)
        out = subprocess.run([sys.executable, "-m", "cuctxd.client", "--endpoint", daemon.endpoint, "shared",
                              "--json", "--prefix", "b-", "--owner", str(hello["session_id"])],
                             capture_output=True, text=True, env=client_env(), cwd=REPO, check=True).stdout
        assert [s["name"] for s in json.loads(out)] == names[1::2]
        peer.ok("free", {"buffer": handle, "device": 0}, token)
        c.unpublish("b-mine")
        assert c.list_shared() == []


def test_writes_pipelined_before_goodbye_land_in_a_published_buffer(daemon: DaemonProcess) -> None:
    """PROTOCOL.md, "Closing": the requests a session queued on a device run before its close there. A
    producer that publishes, pipelines its writes and says goodbye without waiting loses none of them."""
    chunk, chunks = 64 << 10, 32
    with raw_peer(daemon.endpoint) as peer:
        token = peer.hello()
        result, _ = peer.ok("alloc", {"device": 1, "size": chunk * chunks, "shareable": True}, token)
        handle = result["buffer"]["handle"]
        peer.ok("publish", {"device": 1, "buffer": handle, "name": "pipelined"}, token)
        ids = [peer.send("write", {"device": 1, "buffer": handle, "offset": n * chunk}, token,
                         payload=[bytes([n + 1]) * chunk]) for n in range(chunks)]
        goodbye = peer.send("goodbye", {}, token)
        replies = {}
        for _ in range(chunks + 1):
            header, _frames = peer.recv()
            replies[header["id"]] = header
    failed = [replies[rid] for rid in [*ids, goodbye] if not replies[rid]["ok"]]
    assert not failed, failed
    with Client(daemon.endpoint) as consumer, consumer.open_shared("pipelined") as shared:
        view = bytes(shared.host_view())
    assert [view[n * chunk] for n in range(chunks)] == [n + 1 for n in range(chunks)]


def test_a_name_nobody_holds_goes_when_its_orphan_ttl_passes(start_daemons: Callable[..., DaemonProcess]) -> None:
    """The TTL counts while the buffer is kept by its names alone: a hold longer than the TTL does not end
    the name, and its close starts the TTL again; a persistent name has none."""
    daemon = start_daemons("--sim-devices", "1", "--orphan-ttl", "1")
    with Client(daemon.endpoint) as producer:
        producer.publish(producer.alloc(64, shareable=True), "ttl")
        producer.publish(producer.alloc(64, shareable=True), "kept", persistent=True)
    with Client(daemon.endpoint) as consumer:
        with consumer.open_shared("ttl"):
            time.sleep(1.5)  # held past the TTL: the name stays
        assert consumer.lookup("ttl").size == 64  # the TTL started again at the close
        started = time.monotonic()
        assert wait_until(lambda: "ttl" not in {s["name"] for s in consumer.list_shared()}, timeout=5)
        assert time.monotonic() - started >= 0.5
        assert [s["name"] for s in consumer.list_shared()] == ["kept"]
        consumer.unpublish("kept")


def test_an_opened_share_reads_and_writes_its_bytes_whatever_the_backend(daemon: DaemonProcess) -> None:
    """``read``, ``read_into`` and ``write`` of an OpenedShare: the same calls on the sim and on a GPU
    (tests/gpu/test_tensors_gpu.py runs them on cuda)."""
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as reader:
        buf = owner.alloc(4096, shareable=True)
        buf.write(PATTERN)
        with reader.open_shared(buf.export()) as shared:
            assert shared.read() == PATTERN
            assert shared.read(16, offset=4080) == PATTERN[4080:]
            into = bytearray(100)
            assert shared.read_into(into, offset=256) == 100 and bytes(into) == PATTERN[256:356]
            assert shared.write(b"through the mapping", offset=8) == 19
            assert buf.read(19, offset=8) == b"through the mapping"
            with pytest.raises(OutOfRange):
                shared.read(2, offset=4095)
            with pytest.raises(BadArgument, match="writable"):
                shared.read_into(b"not writable")
        with pytest.raises(BadArgument, match="closed"):
            shared.read()
        owner.publish(buf, "read-only-bytes", read_only=True)
        with reader.open_shared("read-only-bytes") as shared:
            with pytest.raises(BadArgument, match="read-only"):
                shared.write(b"x")
            assert shared.read(4) == b"\x00\x01\x02\x03"
        owner.unpublish("read-only-bytes")
