"""Versioned names in the share index (ShareRegistry with its VersionBook): numbering, the current version,
older ones kept while their shares live, re-adoption with their numbers; their parked records."""

from __future__ import annotations

import os
from dataclasses import replace

import msgpack
import pytest

from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.parked_records import ParkedName, ParkedShare, decode_record, encode_record
from cuctxd.daemon.registry.parking import ParkingLot
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.errors import BadArgument, NameExists, NotFound
from tests.unit.daemon.registry import test_parking
from tests.unit.daemon.registry.plain_shares import PlainShare as _Share
from tests.unit.daemon.registry.test_parking import RecordingStore, park

TRAINER = SessionRef("t1", 1, "trainer", 1, uid=7)


def _published(registry: ShareRegistry, count: int) -> list[_Share]:
    shares = [_Share(f"s{i}", TRAINER) for i in range(1, count + 1)]
    for share in shares:
        registry.add(share)
        registry.publish("policy", share, Naming(b"m", 1), version=True)
    return shares


def test_each_version_gets_the_next_number_and_becomes_current_in_one_step() -> None:
    registry = ShareRegistry()
    shares = _published(registry, 3)
    assert [registry.version_of("policy", share.share_id) for share in shares] == [1, 2, 3]
    assert registry.current_version("policy") == 3 and registry.lookup("policy").share_id == "s3"
    assert registry.lookup("policy").version == 3
    assert registry.lookup("policy", version=1).share_id == "s1"  # its share lives on (a holder keeps it)
    assert [entry["version"] for entry in registry.page(NameFilter(), 10)[0]] == [3]
    assert registry.versions_of(shares[0]) == [("policy", 1, Naming(b"m", 1), False)]
    assert registry.versions_of(shares[2]) == [("policy", 3, Naming(b"m", 1), True)]
    registry.remove(shares[0])  # its last holder let go
    with pytest.raises(NotFound, match="no live version 1"):
        registry.lookup("policy", version=1)


def test_a_versioned_name_is_replaced_only_by_its_next_version() -> None:
    registry = ShareRegistry()
    _published(registry, 1)
    plain = _Share("plain", TRAINER)
    registry.add(plain)
    with pytest.raises(BadArgument, match="versioned name"):
        registry.publish("policy", plain, replace=True)
    with pytest.raises(NameExists):
        registry.publish("policy", plain)
    assert registry.current_version("policy") == 1


def test_the_numbering_goes_on_while_a_version_lives_and_starts_again_after() -> None:
    registry = ShareRegistry()
    shares = _published(registry, 2)
    registry.unpublish("policy", TRAINER)
    assert registry.current_version("policy") == 0
    again = _Share("s3", TRAINER)
    registry.add(again)
    registry.publish("policy", again, Naming(b"m", 1), version=True)
    assert registry.current_version("policy") == 3  # version 1 still lives: no second "version 1"
    for share in (*shares, again):
        registry.remove(share)
    fresh = _Share("s4", TRAINER)
    registry.add(fresh)
    registry.publish("policy", fresh, version=True)
    assert registry.current_version("policy") == 1


def test_versions_are_restored_with_their_numbers_and_the_current_one_named() -> None:
    registry = ShareRegistry()
    current, older = _Share("s9", TRAINER), _Share("s8", TRAINER)
    for share in (current, older):
        registry.add(share)
    registry.restore_version("policy", current, Naming(b"m", 1), 9, True)
    registry.restore_version("policy", older, Naming(b"m", 1), 8, False)
    assert registry.lookup("policy").share_id == "s9" and registry.lookup("policy").version == 9
    assert registry.lookup("policy", version=8).share_id == "s8" and older.names == set()
    nxt = _Share("s10", TRAINER)
    registry.add(nxt)
    registry.publish("policy", nxt, version=True)
    assert registry.version_of("policy", "s10") == 10


def test_a_parked_version_keeps_its_number_and_an_older_record_reads_as_unversioned() -> None:
    share = ParkedShare("ab" * 16, 0, "GPU-0", 4096, "sim", "vmm", b"",
                        (ParkedName("policy", b"\x81", 1, False, 4, False),), {"uid": 7})
    assert decode_record(encode_record(share, 3)) == (3, share)
    document = msgpack.unpackb(encode_record(share, 3))
    for name in document["share"]["names"]:
        del name["version"], name["current"]  # as a daemon before versions parked it
    (_, read) = decode_record(msgpack.packb(document, use_bin_type=True))
    assert read.names[0].version == 0 and read.names[0].current


#: The parking tests' store of one test (systemd's, recorded).
store = test_parking.store


def test_an_older_version_keeps_its_name_beside_the_current_one_at_recovery(store: RecordingStore) -> None:
    """Each version's record names the name; only the current one claims it, an older one its number."""
    lot = ParkingLot(store)
    older, current = test_parking.share(0), test_parking.share(1)
    park(lot, replace(older, names=(ParkedName("policy", version=1, current=False),)))
    park(lot, replace(current, names=(ParkedName("policy", version=2),)))
    recovered = ParkingLot(store).recover(store.passed())
    by_id = {s.share_id: [(n.name, n.version, n.current) for n in s.names] for s, _ in recovered.shares}
    assert by_id == {older.share_id: [("policy", 1, False)], current.share_id: [("policy", 2, True)]}
    for _, fd in recovered.shares:
        os.close(fd)
