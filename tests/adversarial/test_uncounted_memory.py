"""Memory counted against nobody (issue 25, item 5), and the limits that now count it:

* helper processes that each send ``hello`` to get round ``max_sessions_per_peer`` meet
  ``max_sessions_per_uid``;
* published buffers left behind by sessions that say goodbye are charged to their uid
  (``max_orphaned_bytes_per_uid``);
* names with large manifests are charged to their session and uid (``max_manifest_bytes_per_*``);
* unread replies of many sessions of one peer are bounded together (``max_reply_bytes_per_peer``).

The bystander (``conftest.py``) is served throughout and nothing is left behind. Each test but the
first passes its daemon's options by parametrizing ``attack_daemon_args``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import msgpack
import pytest

from cuctxd import Client
from cuctxd.client.wire import build as requests
from cuctxd.protos.errors import LimitExceeded
from cuctxd.protos.layouts import MAX_MANIFEST_BYTES
from cuctxd.protos.limits import NAME_OVERHEAD_BYTES
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.adversarial.attacks import BYSTANDER_SIZE, Bystander, assert_alive, rss_bytes
from tests.helpers import REPO, DaemonProcess, client_env, spawn_client, wait_for_line
from tests.helpers_raw import RawPeer, error_name, raw_peer

MIB = 1 << 20
#: Sessions one uid may hold: the bystander's and three of the attacker's helpers.
PER_UID = 4

#: One helper process: one session holding 8 MiB, then it waits to be killed.
HELPER = """
import sys, time
from cuctxd import Client
from cuctxd.protos.errors import LimitExceeded
try:
    c = Client(ENDPOINT, name="helper", timeout=10)
except LimitExceeded as refused:
    print("refused", refused.name, str(refused).split(":")[2].split()[0], flush=True)
    sys.exit(0)
c.alloc(8 << 20, device=0)
print("holding", c.session_id, flush=True)
time.sleep(60)
"""


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    return ("--max-sessions-per-peer", "2", "--max-sessions-per-uid", str(PER_UID), "--session-quota", "8MiB",
            "--lease-ttl", "1")


@pytest.fixture
def helpers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_helper_processes_each_saying_hello_meet_the_per_uid_session_limit(
        attack_daemon: DaemonProcess, bystander: Bystander, helpers: ExitStack) -> None:
    holding = []
    for _ in range(PER_UID - 1):  # the bystander holds the uid's first session
        helper = helpers.enter_context(spawn_client(HELPER, attack_daemon.endpoint))
        helpers.callback(helper.kill)
        holding.append(wait_for_line(helper, "holding"))
    with spawn_client(HELPER, attack_daemon.endpoint) as refused:
        line = wait_for_line(refused, "refused")
        refused.wait(timeout=30)
    assert line.split()[1:] == ["CUCTXD_ERROR_LIMIT_EXCEEDED", "max_sessions_per_uid"], line
    with pytest.raises(LimitExceeded, match=r"^hello: .*max_sessions_per_uid"):
        Client(attack_daemon.endpoint, timeout=10)
    bystander.check()
    helpers.close()  # the helpers die; their leases run out and their sessions end
    deadline = time.monotonic() + 10
    while bystander.client.status()["session_count"] > 1:
        assert time.monotonic() < deadline, "the helpers' sessions outlived their leases"
        time.sleep(0.05)
    assert [s["bytes"] for s in bystander.client.status()["devices"][0]["sessions"]] == [BYSTANDER_SIZE]
    with Client(attack_daemon.endpoint, timeout=10) as after:  # the uid may open sessions again
        assert after.alloc(8 * MIB, device=0).size == 8 * MIB
    assert_alive(attack_daemon)


def _session(peer: RawPeer) -> str:
    result, _ = peer.ok("hello", {"protocol": PROTOCOL_VERSION, "client": "attacker", "pid": os.getpid()})
    return str(result["session"])


def _device_status(client: Client, device: int = 0) -> dict[str, Any]:
    part: dict[str, Any] = client.status()["devices"][device]
    return part


ORPHANS = ("--max-sessions-per-peer", "2", "--max-orphaned-bytes-per-uid", "64MiB")


@pytest.mark.parametrize("attack_daemon_args", [ORPHANS], ids=["orphans"])
def test_published_buffers_left_behind_are_charged_to_their_uid(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    """Publish 8 MiB, say goodbye, repeat 60 times: without an owner for what is left behind, 480 MiB
    of device 0 were held and charged to no session. Now the uid pays: 8 such buffers fill its 64 MiB,
    and its next publishes are refused naming the limit."""
    published, refused = [], []
    with raw_peer(attack_daemon.endpoint) as peer:
        for round_ in range(60):
            session = _session(peer)
            result, _ = peer.ok("alloc", {"size": 8 * MIB, "device": 0, "shareable": True}, session)
            header, _ = peer.call("publish", {"buffer": result["buffer"]["handle"], "name": f"left-{round_}"},
                                  session)
            if header["ok"]:
                published.append(f"left-{round_}")
            else:
                assert error_name(header) == "CUCTXD_ERROR_LIMIT_EXCEEDED", header
                refused.append(header["error"]["message"])
            peer.ok("goodbye", None, session)
            if round_ % 10 == 0:
                bystander.check()
    assert published == [f"left-{n}" for n in range(8)]
    assert len(refused) == 52 and all(m.startswith("max_orphaned_bytes_per_uid:") for m in refused), refused[:2]
    orphaned = _device_status(bystander.client)["orphaned"]
    assert orphaned == {"count": 8, "bytes": 64 * MIB, "top_uids": [{"uid": os.getuid(), "bytes": 64 * MIB}]}
    bystander.check()
    with Client(attack_daemon.endpoint, timeout=10) as owner_uid:  # the uid may remove what it left
        for name in published:
            owner_uid.unpublish(name)
        owner_uid.alloc(8 * MIB, device=0, shareable=True).publish("after")  # and publish again
    device = _device_status(bystander.client)
    assert device["orphaned"] == {"count": 1, "bytes": 8 * MIB, "top_uids": [{"uid": os.getuid(), "bytes": 8 * MIB}]}
    bystander.client.unpublish("after")
    device = _device_status(bystander.client)
    assert (device["share_count"], device["orphaned"]["bytes"]) == (0, 0), device
    assert [s["bytes"] for s in device["sessions"]] == [BYSTANDER_SIZE]
    assert_alive(attack_daemon)


@pytest.mark.parametrize("attack_daemon_args", [ORPHANS[2:]], ids=["orphans"])
def test_sessions_that_end_leaving_more_than_the_limit_free_their_uids_oldest(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    """Two live sessions publish 40 MiB each (nothing is orphaned yet, so both publishes pass); when both
    end, the uid would leave 80 MiB: its oldest orphan is freed, logged, and the newer name stays."""
    with Client(attack_daemon.endpoint, timeout=10) as first, Client(attack_daemon.endpoint, timeout=10) as second:
        first.alloc(40 * MIB, device=0, shareable=True).publish("older")
        second.alloc(40 * MIB, device=0, shareable=True).publish("newer")
        first.close()
    orphaned = _device_status(bystander.client)["orphaned"]
    assert (orphaned["count"], orphaned["bytes"]) == (1, 40 * MIB), orphaned
    assert [entry["name"] for entry in bystander.client.list_shared()] == ["newer"]
    assert "max_orphaned_bytes_per_uid (67108864) reached: freeing the oldest orphaned share" in attack_daemon.log()
    bystander.check()
    bystander.client.unpublish("newer")
    assert _device_status(bystander.client)["share_count"] == 0


def _manifest(size: int) -> bytes:
    """A valid layout of a 4 KiB buffer, padded by its metadata to ``size`` bytes packed."""
    def packed(pad: int) -> bytes:
        return bytes(msgpack.packb({"tensors": [{"name": "t", "dtype": "uint8", "shape": [4096], "strides": None,
                                                 "offset": 0}], "metadata": {"pad": "x" * pad}}))
    overhead = len(packed(1 << 16)) - (1 << 16)
    manifest = packed(size - overhead)
    assert len(manifest) == size
    return manifest


@pytest.mark.parametrize("attack_daemon_args", [()], ids=["defaults"])
def test_names_with_large_manifests_are_charged_to_their_session_and_uid(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    """1,000 names with 512 KiB manifests on one 4 KiB buffer grew the daemon by 490 MiB. Now a session's
    names hold at most 16 MiB and a uid's 64 MiB (the defaults), ended sessions' names included."""
    manifest = _manifest(MAX_MANIFEST_BYTES)
    name_bytes = MAX_MANIFEST_BYTES + len("m-0000-0000") + NAME_OVERHEAD_BYTES
    per_session = (16 * MIB) // name_bytes
    per_uid = (64 * MIB) // name_bytes  # four sessions' worth, and a few names more
    before = rss_bytes(attack_daemon.process.pid)
    refusals: dict[str, int] = {}
    with raw_peer(attack_daemon.endpoint) as peer:
        for round_ in range(5):  # the fifth session finds the uid's 64 MiB full
            session = _session(peer)
            result, _ = peer.ok("alloc", {"size": 4096, "device": 0, "shareable": True}, session)
            handle = result["buffer"]["handle"]
            accepted = 0
            for start in range(0, 1000 if round_ == 0 else 100, 50):
                ids = [peer.send("publish", {"buffer": handle, "name": f"m-{round_:04d}-{n:04d}", "manifest": manifest},
                                 session) for n in range(start, start + 50)]
                for _ in ids:
                    header, _ = peer.recv()
                    if header["ok"]:
                        accepted += 1
                    else:
                        assert error_name(header) == "CUCTXD_ERROR_LIMIT_EXCEEDED", header
                        limit = header["error"]["message"].split(":")[0]
                        refusals[limit] = refusals.get(limit, 0) + 1
            assert accepted == (per_session if round_ < 4 else per_uid - 4 * per_session), (round_, accepted)
            peer.ok("goodbye", None, session)  # its names (and the buffer they keep) stay, charged to the uid
            bystander.check()
    assert refusals["max_manifest_bytes_per_session"] == 1000 - per_session + 3 * (100 - per_session), refusals
    assert refusals["max_manifest_bytes_per_uid"] == 100 - (per_uid - 4 * per_session), refusals
    assert rss_bytes(attack_daemon.process.pid) - before < 160 * MIB
    names = bystander.client.status()["names"]
    assert names["count"] == per_uid and names["bytes"] == per_uid * name_bytes, names
    assert names["top_uids"] == [{"uid": os.getuid(), "bytes": names["bytes"], "names": per_uid}]
    for name in [entry["name"] for entry in bystander.client.list_shared()]:
        bystander.client.unpublish(name)  # the uid's session may remove names left by its ended sessions
    assert bystander.client.status()["names"] == {"count": 0, "bytes": 0, "top_uids": []}
    assert _device_status(bystander.client)["share_count"] == 0
    own = bystander.client.alloc(4096, device=0, shareable=True)  # the bytes were given back
    bystander.client.run(requests.publish(own, "layout", manifest=manifest))
    own.free()
    assert bystander.client.status()["names"]["count"] == 0


#: One process, two connections, 16 sessions: each reads 4 MiB 16 times and leaves the replies unread
#: until told to read them; then it prints what the replies said.
READER = """
import collections, json, os, sys
import msgpack, zmq
from cuctxd.protos.messages import pack
from cuctxd.protos.version import PROTOCOL_VERSION
context = zmq.Context.instance()
sockets = [context.socket(zmq.DEALER) for _ in range(2)]
ids = iter(range(1, 1 << 30))
def call(socket, op, args, session=None):
    header = {"id": next(ids), "op": op, "args": args}
    if session:
        header["session"] = session
    socket.send(pack(header))
    reply = msgpack.unpackb(socket.recv_multipart()[0])
    assert reply["ok"], reply
    return reply["result"]
for socket in sockets:
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(ENDPOINT)
sessions = []
for n in range(16):
    socket = sockets[n % 2]
    token = call(socket, "hello", {"protocol": PROTOCOL_VERSION, "client": "reader", "pid": os.getpid()})["session"]
    handle = call(socket, "alloc", {"size": 4 << 20, "device": 0}, token)["buffer"]["handle"]
    call(socket, "fill", {"buffer": handle, "value": 7}, token)
    sessions.append((socket, token, handle))
for _ in range(16):
    for socket, token, handle in sessions:
        socket.send(pack({"id": next(ids), "op": "read", "session": token, "args": {"buffer": handle}}))
print("sent", flush=True)
sys.stdin.readline()
outcomes = collections.Counter()
for socket in sockets:
    for _ in range(8 * 16):
        reply = msgpack.unpackb(socket.recv_multipart()[0])
        outcomes["ok" if reply["ok"] else reply["error"]["message"].split(":")[0]] += 1
for socket, token, handle in sessions:
    call(socket, "goodbye", None, token)
print(json.dumps(outcomes), flush=True)
"""


def _line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the reader exited: {process.stderr.read() if process.stderr else ''}"
    return line


@pytest.mark.parametrize("attack_daemon_args", [("--max-reply-bytes", "32MiB", "--max-reply-bytes-per-peer",
                                                 "64MiB")], ids=["replies"])
def test_many_sessions_of_one_peer_leaving_replies_unread_are_bounded_together(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    """16 sessions over 2 connections pinned 2 GiB of unread replies: ``max_reply_bytes`` bounded each
    session alone. Now the peer's sessions together hold at most 64 MiB (and one read) on the device."""
    before = rss_bytes(attack_daemon.process.pid)
    script = f"ENDPOINT = {attack_daemon.endpoint!r}\n{READER}"
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=client_env(), cwd=REPO) as reader:
        try:
            assert _line(reader).startswith("sent")
            deadline = time.monotonic() + 20
            while True:  # until every read has run or been refused
                bystander.check()
                queues = _device_status(bystander.client)["queues"]
                if queues and all(q["queued"] == 0 for q in queues):
                    break
                assert time.monotonic() < deadline, queues
                time.sleep(0.05)
            held = sum(q["reply_bytes"] for q in queues)
            assert 0 < held <= 64 * MIB + 4 * MIB, held
            assert rss_bytes(attack_daemon.process.pid) - before < 320 * MIB
            assert reader.stdin is not None
            reader.stdin.write("read\n")
            reader.stdin.flush()
            outcomes = json.loads(_line(reader))
        finally:
            reader.kill()
    # Some replies left ZeroMQ for the sockets' kernel buffers, which count no more: more than 16 ran.
    assert set(outcomes) == {"ok", "max_reply_bytes_per_peer"} and sum(outcomes.values()) == 16 * 16, outcomes
    assert outcomes["max_reply_bytes_per_peer"] > outcomes["ok"] >= 16, outcomes
    deadline = time.monotonic() + 10
    while bystander.client.status()["session_count"] > 1 or _device_status(bystander.client)["queues"]:
        assert time.monotonic() < deadline, "the reader's sessions or replies were left behind"
        time.sleep(0.05)
    bystander.check()
    assert_alive(attack_daemon)
