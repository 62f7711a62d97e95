"""A name's copies on several devices in the ShareRegistry: added, looked up by device, listed, removed one or
all, the first's place taken, staged copies brought in by the publish in one step."""

from __future__ import annotations

import pytest

from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.errors import BadArgument, NameExists, NoCopy, NotFound, NotOwner
from tests.unit.daemon.registry.plain_shares import PlainShare

LAYOUT = Naming(b"m" * 10, 1, digest="xxh3-128:" + "0" * 32)
OTHER = Naming(b"n" * 10, 1, digest="xxh3-128:" + "1" * 32)
ME, AGAIN = SessionRef("t1", 1, "a", 1, uid=7), SessionRef("t2", 2, "a", 2, uid=7)


def _shares(registry: ShareRegistry, owner: SessionRef, *devices: int, prefix: str = "s") -> list[PlainShare]:
    shares = [PlainShare(f"{prefix}{device}", owner, device=device) for device in devices]
    for share in shares:
        registry.add(share)
    return shares


def test_one_copy_per_device_each_looked_up_by_device_and_listed() -> None:
    registry = ShareRegistry()
    first, second, third = _shares(registry, ME, 0, 1, 3)
    with pytest.raises(NotFound, match="publish it before adding copies"):
        registry.publish("llama", second, LAYOUT, copy=True)
    registry.publish("llama", first, LAYOUT)
    with pytest.raises(BadArgument, match="holds its layout"):
        registry.publish("llama", second, OTHER, copy=True)
    assert registry.publish("llama", second, LAYOUT, copy=True) == []
    registry.publish("llama", third, LAYOUT, copy=True)
    again = _shares(registry, AGAIN, 1, prefix="x")[0]
    with pytest.raises(NameExists, match="has a copy on device 1 already"):
        registry.publish("llama", again, LAYOUT, copy=True)
    assert registry.lookup("llama").share_id == "s0"
    assert [registry.lookup("llama", device).share_id for device in (0, 1, 3)] == ["s0", "s1", "s3"]
    with pytest.raises(NoCopy, match=r"no copy on device 2; it has copies on device 0 \(u\), 1 \(u1\), 3 \(u3\)"):
        registry.lookup("llama", 2)
    record = registry.page(NameFilter(), 10)[0][0]
    assert [(c["device"], c["uuid"], c["share_id"]) for c in record["copies"]] == [
        (0, "u", "s0"), (1, "u1", "s1"), (3, "u3", "s3")]
    assert registry.names_status()["count"] == 1 and "llama" in second.names
    assert registry.namings(second) == {"llama": LAYOUT}  # parked with the name, like the first


def test_another_uid_adds_no_copy() -> None:
    registry = ShareRegistry()
    first = _shares(registry, ME, 0)[0]
    stranger = SessionRef("t3", 3, "b", 3, uid=12345)
    theirs = _shares(registry, stranger, 1, prefix="x")[0]
    registry.publish("llama", first, LAYOUT)
    with pytest.raises(NotOwner, match="may add copies of it"):
        registry.publish("llama", theirs, LAYOUT, copy=True)


def test_unpublish_one_copy_or_all_and_the_first_replaced_by_the_next() -> None:
    registry = ShareRegistry()
    first, second, third = _shares(registry, ME, 0, 1, 2)
    registry.publish("llama", first, LAYOUT)
    registry.publish("llama", second, LAYOUT, copy=True)
    registry.publish("llama", third, LAYOUT, copy=True)
    with pytest.raises(NoCopy):
        registry.unpublish("llama", ME, device=5)
    assert registry.unpublish("llama", ME, device=1) == [("s1", 1)]
    assert [c["device"] for c in registry.page(NameFilter(), 10)[0][0]["copies"]] == [0, 2]
    registry.drop_names(first)  # the first copy freed: the next takes its place
    assert registry.lookup("llama").share_id == "s2"
    assert registry.names_status()["count"] == 1
    assert registry.unpublish("llama", ME) == [("s2", 2)]
    with pytest.raises(NotFound):
        registry.lookup("llama")
    assert registry.names_status() == {"count": 0, "bytes": 0, "top_uids": []}


def test_unpublish_all_returns_every_copy() -> None:
    registry = ShareRegistry()
    first, second = _shares(registry, ME, 0, 1)
    registry.publish("llama", first, LAYOUT)
    registry.publish("llama", second, LAYOUT, copy=True)
    assert sorted(registry.unpublish("llama", AGAIN)) == [("s0", 0), ("s1", 1)]


def test_staged_copies_come_in_with_the_replace_in_one_step() -> None:
    registry = ShareRegistry()
    old0, old1 = _shares(registry, ME, 0, 1)
    registry.publish("llama", old0, LAYOUT)
    registry.publish("llama", old1, LAYOUT, copy=True)
    new0, new1, new2 = _shares(registry, ME, 0, 1, 2, prefix="n")
    registry.publish("llama", new1, OTHER, stage=True)
    registry.publish("llama", new2, OTHER, stage=True)
    assert registry.lookup("llama", 1).share_id == "s1"  # staged: not looked up before the publish
    with pytest.raises(NoCopy):
        registry.lookup("llama", 2)
    wrong = _shares(registry, ME, 3, prefix="w")[0]
    registry.publish("llama", wrong, LAYOUT, stage=True)
    with pytest.raises(BadArgument, match="staged on device 3 holds another layout"):
        registry.publish("llama", new0, OTHER, replace=True)
    registry.drop_names(wrong)  # freed: no longer staged
    assert sorted(registry.publish("llama", new0, OTHER, replace=True)) == [("s0", 0), ("s1", 1)]
    assert [registry.lookup("llama", device).share_id for device in (0, 1, 2)] == ["n0", "n1", "n2"]
    assert registry.lookup("llama").manifest == OTHER.manifest


def test_a_fresh_publish_brings_its_staged_copies_and_another_sessions_stay_out() -> None:
    registry = ShareRegistry()
    first, second = _shares(registry, ME, 0, 1)
    theirs = _shares(registry, AGAIN, 2, prefix="x")[0]
    registry.publish("llama", second, LAYOUT, stage=True)
    registry.publish("llama", theirs, LAYOUT, stage=True)
    with pytest.raises(NotFound):
        registry.lookup("llama")
    registry.publish("llama", first, LAYOUT)
    assert [c["device"] for c in registry.page(NameFilter(), 10)[0][0]["copies"]] == [0, 1]


def test_a_staged_copy_whose_owner_lets_go_is_no_copy() -> None:
    registry = ShareRegistry()
    first, second = _shares(registry, ME, 0, 1)
    registry.publish("llama", second, LAYOUT, stage=True)
    assert registry.namings(second) == {"llama": LAYOUT}  # parked with what it was staged with
    registry.unstage(second)
    assert "llama" not in second.names
    registry.publish("llama", first, LAYOUT)
    assert [c["device"] for c in registry.page(NameFilter(), 10)[0][0]["copies"]] == [0]
    registry.unstage(first)  # a first copy is not staged: nothing changes
    assert registry.lookup("llama").share_id == "s0"
