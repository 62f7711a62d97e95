"""ShareRegistry at scale: ``list_shared`` pages and their filters against a model, ``max_names_per_uid``,
and what a name is charged against what it costs (tracemalloc)."""

from __future__ import annotations

import gc
import threading
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import NAMES_PER_HOLD, ShareLimits, ShareRegistry
from cuctxd.protos.errors import LimitExceeded
from tests.unit.daemon.registry.plain_shares import PlainShare

#: Publishers: sessions 1 and 2 of uid 7, session 3 of uid 8, session 4 of no known uid (tcp://).
OWNERS = [SessionRef(f"t{n}", n, "c", n, uid=uid) for n, uid in ((1, 7), (2, 7), (3, 8), (4, None))]
PREFIXES = ["", "a", "a-", "b", "b-9", "z"]


def _crowd() -> tuple[ShareRegistry, dict[str, SessionRef]]:
    """A registry with 600 names over four publishers, and each name's owner."""
    registry = ShareRegistry(ShareLimits(0, 0, 0))
    shares = [PlainShare(f"s{owner.public_id}", owner) for owner in OWNERS]
    owner_of = {}
    for share in shares:
        registry.add(share)
    for n in range(600):
        name = f"{'ab'[n % 2]}{'-' if n % 5 == 0 else ''}{n * 7919 % 1000:03d}"
        share = shares[n % 4]
        registry.publish(name, share)
        owner_of[name] = share.owner
    return registry, owner_of


REGISTRY, OWNER_OF = _crowd()


@settings(max_examples=200, deadline=None)
@given(prefix=st.sampled_from(PREFIXES), session=st.sampled_from([None, 1, 2, 3, 4, 9]),
       uid=st.sampled_from([None, 7, 8, 9]), limit=st.sampled_from([1, 2, 7, 100, 1000]),
       after=st.one_of(st.none(), st.sampled_from(sorted(OWNER_OF)), st.text(alphabet="ab-09", max_size=4)))
def test_paging_with_filters_lists_each_selected_name_once_in_order(prefix: str, session: int | None,
                                                                   uid: int | None, limit: int,
                                                                   after: str | None) -> None:
    expected = sorted(name for name, owner in OWNER_OF.items()
                      if name.startswith(prefix) and (after is None or name > after)
                      and (session is None or owner.public_id == session) and (uid is None or owner.uid == uid))
    listed: list[str] = []
    cursor = after
    while True:
        records, more, count = REGISTRY.page(NameFilter(cursor, prefix, session, uid), limit)
        assert count == len(OWNER_OF) and len(records) <= limit
        assert all(OWNER_OF[r["name"]].public_id == r["owner"] == r["publisher"]["session"] for r in records)
        listed += [r["name"] for r in records]
        if not more:
            break
        assert len(records) == limit
        cursor = records[-1]["name"]
    assert listed == expected


def test_a_uid_may_publish_max_names_per_uid_names_and_other_uids_are_unaffected() -> None:
    registry = ShareRegistry(ShareLimits(0, 0, max_names_per_uid=3))
    mine, again, theirs, unknown = (PlainShare(f"s{n}", owner) for n, owner in enumerate(OWNERS, 1))
    for share in (mine, again, theirs, unknown):
        registry.add(share)
    registry.publish("a", mine)
    registry.publish("b", mine)
    registry.publish("c", again)  # the uid's third, from another of its sessions
    with pytest.raises(LimitExceeded, match=r"^.*\): max_names_per_uid: the sessions of uid 7 have published 3 "):
        registry.publish("d", again)
    assert registry.publish("c", mine, replace=True) == [("s2", 0)]  # a name of the same uid moving: not one more
    for n in range(3):
        registry.publish(f"theirs-{n}", theirs)
        registry.publish(f"unknown-{n}", unknown)
    with pytest.raises(LimitExceeded, match="max_names_per_uid: the sessions of peers whose uid is unknown"):
        registry.publish("unknown-3", unknown)
    registry.unpublish("a", OWNERS[1])
    registry.publish("d", again)
    assert [(entry["uid"], entry["names"]) for entry in registry.names_status()["top_uids"]] == [
        (None, 3), (8, 3), (7, 3)]  # by their bytes: "unknown-N" is the longest name


@pytest.mark.parametrize("manifest", [False, True], ids=["plain", "with a layout"])
@pytest.mark.parametrize("length", [1, 40, 256])
def test_a_name_is_charged_at_least_what_the_registry_keeps_of_it(manifest: bool, length: int) -> None:
    """What ``publish`` charges a name (``Naming.charged``: its manifest, its bytes, NAME_OVERHEAD_BYTES) covers
    the memory the registry and the share keep for it, the name's own string (decoded from the request)
    included: measured with tracemalloc over many names, as the issue measured RSS (150,000 names charged
    0.9 MB that grew the daemon by 16.9 MB)."""
    registry = ShareRegistry(ShareLimits(0, 0, 0))
    shares = [PlainShare(f"s{owner.public_id}", owner) for owner in OWNERS]
    for share in shares:
        registry.add(share)
    count = 4000
    encoded = [(f"{n:06d}" * 43)[:length].encode() if length >= 6 else bytes([65 + n % 26]) * length
               for n in range(count)]
    naming = Naming(b"m" * 64, 1, False, "xxh3-128:" + "0" * 32) if manifest else Naming()
    charged = 0
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n, raw in enumerate(encoded):
            name = raw.decode() + f"{n:x}"  # a fresh string per name, as the daemon decodes each request
            registry.publish(name, shares[n % 4], naming)
            charged += naming.charged(name)
        del name
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert registry.names_status()["count"] == count
    assert kept <= charged, f"{kept / count:.0f} bytes kept per name, {charged / count:.0f} charged"


def test_a_share_with_thousands_of_names_gives_them_up_a_few_hundred_per_hold_of_the_lock() -> None:
    """Freeing a buffer with 16,384 names held the registry's lock, which every lookup and page on the front
    takes, for about 0.1 s; now each hold forgets at most NAMES_PER_HOLD of them."""
    registry = ShareRegistry(ShareLimits(0, 0, 0))
    forgotten_per_hold: list[int] = []

    class CountingLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            self.lock.acquire()
            forgotten_per_hold.append(0)

        def __exit__(self, *_: object) -> None:
            self.lock.release()

    forget = registry._forget_name

    def counted(name: str, of_share: str | None = None) -> None:
        forgotten_per_hold[-1] += 1
        forget(name, of_share)

    share = PlainShare("s1", OWNERS[0])
    registry.add(share)
    for n in range(3 * NAMES_PER_HOLD + 5):
        registry.publish(f"n-{n:05d}", share)
    registry._lock = CountingLock()  # type: ignore[assignment]
    registry._forget_name = counted  # type: ignore[method-assign]
    registry.remove(share)
    assert max(forgotten_per_hold) == NAMES_PER_HOLD and sum(forgotten_per_hold) == 3 * NAMES_PER_HOLD + 5
    assert registry.names_status() == {"count": 0, "bytes": 0, "top_uids": []}
    assert registry.page(NameFilter(), 10) == ([], False, 0) and len(registry) == 0


def test_a_session_id_of_an_adopted_share_and_a_new_session_are_told_apart_by_uid() -> None:
    """A parked share adopted after a restart keeps its old publisher's public id; a new session may have it too."""
    registry = ShareRegistry(ShareLimits(0, 0, 0))
    adopted, new = PlainShare("s1", SessionRef("parked-x", 5, "old", 1, uid=7)), PlainShare(
        "s2", SessionRef("t5", 5, "new", 2, uid=8))
    for share in (adopted, new):
        registry.add(share)
    for n in range(3):
        registry.publish(f"old-{n}", adopted)
        registry.publish(f"new-{n}", new)
    names = [r["name"] for r in registry.page(NameFilter(session=5), 10)[0]]
    assert names == ["new-0", "new-1", "new-2", "old-0", "old-1", "old-2"]
    records, more, _ = registry.page(NameFilter(session=5, uid=7), 2)
    assert [r["name"] for r in records] == ["old-0", "old-1"] and more
    assert [r["name"] for r in registry.page(NameFilter("old-1", session=5, uid=7), 2)[0]] == ["old-2"]
    assert registry.page(NameFilter(session=5, uid=9), 10) == ([], False, 6)
