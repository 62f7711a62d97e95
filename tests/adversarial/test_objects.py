"""One client against the daemon's objects: floods of contexts and exports, quota evasion through its
own shares, pinning others' memory, squatting names. Each runs a real sim daemon and checks that a
bystander session keeps its bytes and is served within a stated bound."""

from __future__ import annotations

import os
import pwd
import threading
import time
from collections.abc import Iterator

import pytest

from cuctxd import Client, CudaError, NotFound, NotOwner, Revoked
from cuctxd.client.api.objects import Context
from cuctxd.client.wire import build
from cuctxd.protos.errors import LimitExceeded
from tests.helpers import DaemonProcess, start_daemon, tcp_endpoint

#: Longest a bystander's device op may wait while another session's objects are being freed.
BYSTANDER_BOUND_S = 0.5
MIB = 1 << 20


@pytest.fixture
def stop_after() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for daemon in started:
        daemon.stop()


def daemon_with(stop_after: list[DaemonProcess], *flags: str) -> DaemonProcess:
    daemon = start_daemon(*flags)
    stop_after.append(daemon)
    return daemon


class Bystander:
    """Another session with a buffer of known bytes; :meth:`check` asks device 0 for its memory info."""

    def __init__(self, endpoint: str) -> None:
        self.client = Client(endpoint, name="bystander")
        self.buffer = self.client.alloc(4096)
        self.buffer.fill(0x5A)
        self.slowest = 0.0

    def check(self) -> None:
        start = time.monotonic()
        self.client.mem_get_info(0)
        self.slowest = max(self.slowest, time.monotonic() - start)

    def close(self) -> None:
        assert self.buffer.read(16) == b"\x5a" * 16
        self.client.close()


def closing_sessions(client: Client) -> int:
    return sum(device.get("closing_sessions", 0) for device in client.status()["devices"])


def test_a_context_flood_is_capped_and_its_cleanup_never_stalls_a_bystander(
        stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--max-contexts-per-session", "0", "--max-objects-per-session", "0")
    bystander = Bystander(daemon.endpoint)
    attacker = Client(daemon.endpoint, name="attacker")
    contexts = 12_000
    with attacker.pipeline() as pipeline:
        for _ in range(contexts):
            pipeline.send(build.create_context(attacker, Context, 0, 0))
    bystander.check()

    done = threading.Event()

    def poll_bystander() -> None:
        while not done.is_set():
            bystander.check()

    poller = threading.Thread(target=poll_bystander)
    poller.start()
    start = time.monotonic()
    try:
        attacker.close()
        while closing_sessions(bystander.client):
            assert time.monotonic() - start < 30, "12,000 contexts not freed in 30 s"
            time.sleep(0.05)
    finally:
        done.set()
        poller.join()
    assert bystander.slowest < BYSTANDER_BOUND_S, f"a bystander waited {bystander.slowest:.3f} s"
    assert daemon.process.poll() is None
    device = bystander.client.status()["devices"][0]
    assert [c for c in device["contexts"] if not c["is_primary"]] == []
    bystander.close()


def test_contexts_per_session_have_a_default_cap_that_names_itself(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after)
    bystander = Bystander(daemon.endpoint)
    with Client(daemon.endpoint) as attacker:
        for _ in range(64):
            attacker.create_context(0)
        with pytest.raises(LimitExceeded, match="max_contexts_per_session"):
            attacker.create_context(0)
        attacker.create_context(1)  # per device
    bystander.check()
    assert bystander.slowest < BYSTANDER_BOUND_S
    bystander.close()


def test_an_export_flood_hits_the_shares_cap(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--max-shares-per-session", "200")
    bystander = Bystander(daemon.endpoint)
    with Client(daemon.endpoint) as attacker:
        buffers = [attacker.alloc(1, 0, shareable=True) for _ in range(201)]
        for buffer in buffers[:200]:
            buffer.publish(f"flood-{buffer.handle}")
        with pytest.raises(LimitExceeded, match="max_shares_per_session"):
            buffers[200].export()
        buffers[0].free()  # an export freed makes room
        buffers[200].export()
    bystander.check()
    assert daemon.process.poll() is None
    bystander.close()


def test_orphaned_published_shares_are_capped_daemon_wide(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--max-orphaned-shares", "10")
    for _ in range(2):
        with Client(daemon.endpoint) as producer:
            for n in range(8):
                buffer = producer.alloc(1, 0, shareable=True)
                buffer.publish(f"orphan-{producer.session_id}-{n}")
    with Client(daemon.endpoint) as observer:
        shared = observer.list_shared()
        assert len(shared) == 10
        assert {s["name"].rsplit("-", 1)[1] for s in shared} >= {"7"}  # the newest survive
        assert sum(len(d["shares"]) for d in observer.status()["devices"]) == 10


def test_holding_your_own_share_counts_against_your_quota(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--session-quota", "8MiB")
    with Client(daemon.endpoint) as attacker:
        buffer = attacker.alloc(6 * MIB, 0, shareable=True)
        share = attacker.open_shared(buffer.export())
        buffer.free()
        with pytest.raises(CudaError, match="quota"):
            attacker.alloc(6 * MIB, 0)
        mine = [s for s in attacker.status()["devices"][0]["sessions"] if s["session"] == attacker.session_id]
        assert mine[0]["bytes"] == 0 and mine[0]["held_bytes"] == 6 * MIB and mine[0]["quota"] == 8 * MIB
        assert attacker.memory_info(0)["free"] == 2 * MIB
        share.close()
        attacker.alloc(6 * MIB, 0)  # the hold was what counted


def test_holding_another_sessions_share_counts_against_the_holders_quota(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--session-quota", "8MiB")
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as holder:
        big = owner.alloc(6 * MIB, 0, shareable=True)
        holder.alloc(4 * MIB, 0)
        with pytest.raises(CudaError, match="quota"):
            holder.open_shared(big.export())


def test_an_owner_revokes_a_share_and_the_holder_is_told(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after)
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as holder:
        buffer = owner.alloc(4096, 0, shareable=True)
        descriptor = buffer.publish("revocable")
        share = holder.open_shared("revocable")
        with pytest.raises(Exception, match="NOT_OWNER"):
            holder.revoke(descriptor)
        buffer.revoke()
        with pytest.raises(NotFound):
            holder.lookup("revocable")
        with pytest.raises(Revoked):
            share.close()
        with pytest.raises(Revoked):
            holder.open_shared(descriptor)
        device = owner.status()["devices"][0]
        held = [s for s in device["shares"] if descriptor.share_id.startswith(s["share_id"])]
        assert held[0]["revoked"] and held[0]["holders"] == []
        buffer.free()
        assert not [s for s in owner.status()["devices"][0]["shares"]
                    if descriptor.share_id.startswith(s["share_id"])]


def test_lookup_says_who_published_and_only_that_user_may_unpublish(stop_after: list[DaemonProcess]) -> None:
    # ipc://: the kernel says which user the publisher runs as; tcp://: nobody says, so not the same user
    daemon = daemon_with(stop_after, "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")
    with Client(daemon.endpoint, name="producer") as producer, Client(daemon.endpoint) as consumer, \
            Client(tcp_endpoint(daemon)) as stranger:
        producer.alloc(64, 0, shareable=True).publish("weights")
        publisher = consumer.lookup("weights").publisher
        assert publisher == {"session": producer.session_id, "client": "producer", "pid": os.getpid(),
                             "uid": os.getuid()}
        listed = consumer.list_shared()
        assert listed[0]["publisher"]["client"] == "producer"
        with pytest.raises(NotOwner, match=f"only a session of uid {os.getuid()}"):
            stranger.unpublish("weights")
        stranger.alloc(64, 0, shareable=True).publish("the-strangers")
        with Client(tcp_endpoint(daemon)) as another, pytest.raises(NotOwner, match="itself"):
            another.unpublish("the-strangers")  # its uid unknown: no other session is its user
        consumer.unpublish("weights")  # the publisher's user, from another session
        consumer.unpublish("the-strangers")  # the daemon's own user administers every name
        assert consumer.list_shared() == []


def test_a_scoped_name_needs_a_known_uid(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after, "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")  # nobody says who
    with Client(tcp_endpoint(daemon)) as squatter:
        with pytest.raises(Exception, match="NOT_OWNER"):
            squatter.alloc(64, 0, shareable=True).publish("root/weights")
        squatter.alloc(64, 0, shareable=True).publish("unscoped")


def test_a_scoped_name_of_ones_own_user_needs_no_option_on_ipc(stop_after: list[DaemonProcess]) -> None:
    daemon = daemon_with(stop_after)
    user = pwd.getpwuid(os.getuid()).pw_name
    with Client(daemon.endpoint, name="owner") as owner, Client(daemon.endpoint) as consumer:
        owner.alloc(64, 0, shareable=True).publish(f"{user}/weights")
        assert consumer.lookup(f"{user}/weights").publisher["uid"] == os.getuid()
