"""Many published names (issue 41, item 2): 150,000 names on one buffer, within the default limits, were
charged 0.9 MB and grew the daemon by 16.9 MB; one ``list_shared`` of them took 489 ms on the front thread,
and pipelined listings stalled a bystander's worst op to 9.55 s.

* Pipelined listings cost the front a page each, whatever the number of names: a bystander whose ops pass
  the front (its device ops too: ``device_endpoints=False``) is served as promptly under listings of
  30,000 names as under listings of one page of names, measured in the same test.
* ``max_names_per_uid`` refuses a uid's names past it by name, while a peer of another uid (tcp://: uid
  unknown) still publishes; the names the daemon kept are charged at least the memory they took.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cuctxd import Client
from cuctxd.protos.limits import MAX_LISTED
from tests.adversarial.attacks import FIGURES, Bystander, call_many, flood, rss_bytes, scaled
from tests.helpers import DaemonProcess, tcp_endpoint
from tests.helpers_raw import RawPeer, error_name, raw_peer

#: Names in the large registry; the issue's 150,000 stalled in proportion, this is enough to show it.
MANY = scaled(30_000)
#: Listings pipelined at once: a front batch's worth (``intake/router_io.py``'s BATCH).
LISTINGS = 64
#: The bystander's worst op under listings of MANY names may be at most this many times its worst under
#: listings of one page of names, plus SLACK_S (a shared CI machine's scheduling noise).
RATIO = 4.0
SLACK_S = 0.5
#: Rounds of listings per measurement.
ROUNDS = 2
#: The default max_names_per_uid (PROTOCOL.md, "Daemon limits").
DEFAULT_MAX_NAMES_PER_UID = 16384


class FrontBystander:
    """A session whose every op passes the daemon's front: ``lookup`` of its name, and ``read`` through the
    main endpoint (its reply forwarded by the front)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.buffer = client.alloc(4096, device=0, shareable=True)
        self.data = bytes(range(256)) * 16
        self.buffer.write(self.data)
        self.share_id = client.publish(self.buffer, "front-bystander").share_id

    def op(self) -> float:
        started = time.monotonic()
        assert self.client.lookup("front-bystander").share_id == self.share_id
        assert self.client.read(self.buffer) == self.data
        return time.monotonic() - started


@contextmanager
def front_bystander(endpoint: str) -> Iterator[FrontBystander]:
    with Client(endpoint, timeout=60, name="front-bystander", device_endpoints=False) as client:
        bystander = FrontBystander(client)
        yield bystander
        bystander.buffer.free()


def publish_names(peer: RawPeer, session: str, handle: int, first: int, last: int) -> None:
    call_many(peer, "publish", [{"buffer": handle, "name": f"n-{n:07d}", "device": 0} for n in range(first, last)],
              session)


def worst_op_under_listings(peer: RawPeer, session: str, bystander: FrontBystander, names: int) -> float:
    """Pipeline LISTINGS full pages of ``list_shared``, ROUNDS times; the bystander's slowest op until all are
    answered, in the round where it was fastest (a stall comes every round, a busy machine's hiccup in one)."""
    return min(_worst_op_in_one_round(peer, session, bystander, names) for _ in range(ROUNDS))


def _worst_op_in_one_round(peer: RawPeer, session: str, bystander: FrontBystander, names: int) -> float:
    ids = set(flood(peer, "list_shared", {"limit": MAX_LISTED}, session, LISTINGS))
    assert len(ids) == LISTINGS
    worst = 0.0
    while ids:
        worst = max(worst, bystander.op())
        while ids and peer.socket.poll(0):
            header, _ = peer.recv()
            assert header["ok"] is True, header
            page = header["result"]
            assert page["count"] == names + 1 and len(page["shared"]) == min(MAX_LISTED, names + 1)
            ids.discard(header["id"])
    return worst


@pytest.mark.parametrize("attack_daemon_args", [("--max-names-per-uid", "0")], ids=["names unbounded"])
def test_pipelined_listings_of_many_names_cost_the_front_a_page_each(attack_daemon: DaemonProcess,
                                                                     bystander: Bystander) -> None:
    with raw_peer(attack_daemon.endpoint) as peer, front_bystander(attack_daemon.endpoint) as innocent:
        session = peer.hello()
        handle = peer.ok("alloc", {"size": 4096, "device": 0, "shareable": True}, session)[0]["buffer"]["handle"]
        publish_names(peer, session, handle, 0, MAX_LISTED - 1)  # with the bystander's: one page of names
        baseline = worst_op_under_listings(peer, session, innocent, MAX_LISTED - 1)
        publish_names(peer, session, handle, MAX_LISTED - 1, MANY)
        bystander.check()
        worst = worst_op_under_listings(peer, session, innocent, MANY)
        listed = innocent.client.list_shared(prefix="n-")
        assert [entry["name"] for entry in listed] == [f"n-{n:07d}" for n in range(MANY)]
        mine = innocent.client.list_shared(owner=innocent.client.session_id)
        assert [entry["name"] for entry in mine] == ["front-bystander"]
        peer.ok("free", {"buffer": handle, "device": 0}, session)
        bystander.check()
    FIGURES["test_names_at_scale"] = [
        f"bystander's worst op under {LISTINGS} pipelined listings (best of {ROUNDS} rounds): "
        f"{baseline * 1000:.1f} ms with "
        f"{MAX_LISTED} names, {worst * 1000:.1f} ms with {MANY} names"]
    assert worst <= RATIO * baseline + SLACK_S, (
        f"the bystander's worst op took {worst:.3f} s under listings of {MANY} names, {baseline:.3f} s under "
        f"listings of {MAX_LISTED}: the front's cost grows with the registry")


@pytest.mark.parametrize("attack_daemon_args", [("--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")],
                         ids=["defaults, and tcp://"])
def test_a_uid_past_max_names_per_uid_is_refused_by_name_and_another_uid_is_not(attack_daemon: DaemonProcess,
                                                                                bystander: Bystander) -> None:
    extra = 500
    before = rss_bytes(attack_daemon.process.pid)
    with raw_peer(attack_daemon.endpoint) as peer:
        session = peer.hello()
        handle = peer.ok("alloc", {"size": 4096, "device": 0, "shareable": True}, session)[0]["buffer"]["handle"]
        refused: dict[str, int] = {}
        for start in range(0, DEFAULT_MAX_NAMES_PER_UID + extra, 256):
            ids = [peer.send("publish", {"buffer": handle, "name": f"n-{n:07d}", "device": 0}, session)
                   for n in range(start, min(start + 256, DEFAULT_MAX_NAMES_PER_UID + extra))]
            for _ in ids:
                header, _ = peer.recv()
                if not header["ok"]:
                    assert error_name(header) == "CUCTXD_ERROR_LIMIT_EXCEEDED", header
                    limit = header["error"]["message"].split(":")[0]
                    refused[limit] = refused.get(limit, 0) + 1
        bystander.check()
        grown = rss_bytes(attack_daemon.process.pid) - before
        names = bystander.client.status()["names"]
        assert refused == {"max_names_per_uid": extra}, refused
        assert names["count"] == DEFAULT_MAX_NAMES_PER_UID
        assert grown <= names["bytes"], f"{DEFAULT_MAX_NAMES_PER_UID} names grew the daemon by {grown} bytes, " \
                                        f"charged {names['bytes']}"
        with Client(tcp_endpoint(attack_daemon), timeout=30, name="another-uid") as other:
            theirs = other.alloc(4096, device=0, shareable=True)
            other.publish(theirs, "another-uids-name")
            assert other.lookup("another-uids-name").publisher["uid"] is None
            assert [s["name"] for s in other.list_shared(prefix="another")] == ["another-uids-name"]
            theirs.free()
        peer.ok("free", {"buffer": handle, "device": 0}, session)
    FIGURES["test_names_at_scale: max_names_per_uid"] = [
        f"{DEFAULT_MAX_NAMES_PER_UID} names: daemon RSS grew {grown / 2**20:.1f} MiB, charged "
        f"{names['bytes'] / 2**20:.1f} MiB"]
    assert bystander.client.status()["names"]["count"] == 0
