"""The parked records' format and the parking lot's bookkeeping against a store that records what it is sent."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import msgpack
import pytest

from cuctxd.daemon.registry.fd_budget import FdBudget, FdPlan
from cuctxd.daemon.registry.parked_records import (
    FORMAT_VERSION,
    ParkedName,
    ParkedShare,
    ParkError,
    decode_record,
    decode_registry,
    encode_record,
    encode_registry,
    record_fdname,
)
from cuctxd.daemon.registry.parking import ParkingLimits, ParkingLot
from cuctxd.protos.errors import NotParked
from cuctxd.protos.memfd import sealed_memfd

SHARE = ParkedShare("ab" * 16, 0, "GPU-0", 4096, "sim", "pool", bytes(range(64)),
                    (ParkedName("model", b"\x81\xa1a\x01", 3, True), ParkedName("alias")),
                    {"session": 7, "client": "loader", "pid": 42, "uid": 1000})


def share(index: int, uid: int = 1000, *names: str) -> ParkedShare:
    return replace(SHARE, share_id=f"{index:032x}", names=tuple(ParkedName(n) for n in names or (f"n{index}",)),
                   publisher={**SHARE.publisher, "uid": uid})


@dataclass
class RecordingStore:
    """Keeps a copy of every fd stored, by name, as systemd would; ``events`` in order."""

    limit: int | None = None
    stored: dict[str, list[int]] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)

    def store(self, name: str, fd: int) -> bool:
        self.stored.setdefault(name, []).append(os.dup(fd))
        self.events.append(("store", name))
        return True

    def remove(self, name: str) -> bool:
        self.events.append(("remove", name))
        for fd in self.stored.pop(name, []):
            os.close(fd)
        return True

    def close(self) -> None:
        for fds in self.stored.values():
            for fd in fds:
                os.close(fd)
        self.stored.clear()

    def passed(self) -> list[tuple[str, int]]:
        """What a restart would pass the next daemon: a copy of each stored fd with its name."""
        return [(name, os.dup(fd)) for name, fds in self.stored.items() for fd in fds]


@pytest.fixture
def store() -> Iterator[RecordingStore]:
    recording = RecordingStore()
    yield recording
    recording.close()


def park(lot: ParkingLot, parked: ParkedShare) -> None:
    memory = sealed_memfd("share", 4096)
    try:
        lot.park(parked, memory)
    finally:
        os.close(memory)


def test_a_record_decodes_to_what_was_encoded() -> None:
    assert decode_record(encode_record(SHARE, 5)) == (5, SHARE)
    assert decode_registry(encode_registry([SHARE], 5)) == (5, [SHARE])


@pytest.mark.parametrize("raw", [
    b"", b"\x90", b"\x81", msgpack.packb({"format": FORMAT_VERSION + 1, "generation": 1, "share": {}}),
    msgpack.packb({"format": 1, "generation": 1, "share": {}}),
    encode_record(SHARE, 1).replace(b"\xa4pool", b"\xa4nvlk"),
    encode_record(SHARE, 1).replace(b"ab" * 16, b"../etc/passwd/../" * 2 + b"xx"),
    encode_record(SHARE, 1)[:-10],
])
def test_a_record_that_cannot_be_verified_is_a_park_error(raw: bytes) -> None:
    with pytest.raises(ParkError):
        decode_record(raw)


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{", json.dumps({"format": FORMAT_VERSION + 1, "generation": 1, "shares": []}).encode(),
    json.dumps({"generation": 1, "shares": []}).encode(),
    encode_registry([SHARE], 1).replace(b'"size":4096', b'"size":"4096"'),
    encode_registry([SHARE], 1)[:-10],
])
def test_a_format_1_registry_that_cannot_be_verified_is_a_park_error(raw: bytes) -> None:
    with pytest.raises(ParkError):
        decode_registry(raw)


def test_parking_stores_memory_then_record_and_a_change_replaces_the_record_alone(store: RecordingStore) -> None:
    lot = ParkingLot(store)
    park(lot, SHARE)
    assert store.events == [("store", SHARE.fdname), ("store", record_fdname(SHARE.share_id, 1))]
    lot.update(replace(SHARE, names=SHARE.names[:1]))
    assert store.events[2:] == [("store", record_fdname(SHARE.share_id, 2)),
                                ("remove", record_fdname(SHARE.share_id, 1))]
    lot.unpark(SHARE.share_id)
    assert store.events[4:] == [("remove", record_fdname(SHARE.share_id, 2)), ("remove", SHARE.fdname)]
    assert store.stored == {}


def test_a_change_writes_its_own_record_whatever_else_is_parked(store: RecordingStore) -> None:
    lot = ParkingLot(store)
    park(lot, SHARE)
    one = lot.record_bytes_written
    for index in range(50):
        park(lot, replace(share(index), names=(ParkedName(f"big{index}", b"m" * 100_000),)))
    before = lot.record_bytes_written
    lot.update(replace(SHARE, names=SHARE.names[:1]))
    assert lot.record_bytes_written - before < one


def test_each_uid_gets_its_share_of_the_store_and_status_says_so(store: RecordingStore) -> None:
    store.limit = 64  # a quarter each: 16 fds, 8 shares
    lot = ParkingLot(store)
    for index in range(8):
        park(lot, share(index, uid=1000))
    with pytest.raises(NotParked, match="max_parked_fds_per_uid: uid 1000 has 16 fds"):
        park(lot, share(8, uid=1000))
    with pytest.raises(NotParked):
        lot.check_room(1000)
    park(lot, share(9, uid=2000))  # another uid still parks
    lot.check_room(None)
    status = lot.to_status()
    assert status["uids"] == [{"uid": 1000, "fds": 16}, {"uid": 2000, "fds": 2}]
    assert (status["fds"], status["shares"], status["max_per_uid"], status["refused"]) == (18, 9, 16, 2)
    assert sum(1 for name in store.stored if name.startswith("cuctxd-share-")) == 9


def test_a_full_store_refuses_and_keeps_a_slot_for_a_records_next_generation(store: RecordingStore) -> None:
    store.limit = 7
    lot = ParkingLot(store, limits=ParkingLimits(max_parked_fds_per_uid=7))
    for index in range(3):
        park(lot, share(index))
    with pytest.raises(NotParked, match="fd store is full: 6 of its 7"):
        park(lot, share(3))
    lot.update(share(0, 1000, "renamed"))  # the spare slot: stored before the previous record goes
    assert len([fd for fds in store.stored.values() for fd in fds]) == 6


def test_parked_fds_count_against_the_fd_budget(store: RecordingStore) -> None:
    budget = FdBudget(FdPlan(1024, 256, 384, 384, 4, 4))
    lot = ParkingLot(store, budget)
    park(lot, share(0))
    park(lot, share(1))
    assert budget.held_by("parked, uid 1000") == 4 and budget.held == 4
    with pytest.raises(NotParked, match="fd budget: max_client_fds_per_peer"):
        park(lot, share(2))
    lot.unpark(share(0).share_id)
    assert budget.held == 2
    assert not any(name.startswith(f"cuctxd-share-{share(2).share_id}") for name in store.stored)


def test_recovery_pairs_the_newest_record_with_its_memory_and_drops_the_rest(store: RecordingStore) -> None:
    first = ParkingLot(store)
    park(first, SHARE)
    first.update(replace(SHARE, names=SHARE.names[:1]))
    stale = record_fdname(SHARE.share_id, 1)
    raw = encode_record(SHARE, 1)  # an older record left behind (a kill between store and remove)
    fd = sealed_memfd("old", len(raw))
    os.pwrite(fd, raw, 0)
    passed = [*store.passed(), (stale, fd), ("cuctxd-share-" + "cd" * 16, os.dup(fd))]
    lot = ParkingLot(store)
    recovered = lot.recover(passed)
    assert [s for s, _ in recovered.shares] == [replace(SHARE, names=SHARE.names[:1])]
    for parked, fd in recovered.shares:
        lot.adopted(parked, fd)
        os.close(fd)
    lot.commit()
    assert recovered.skipped == 1 and ("remove", "cuctxd-share-" + "cd" * 16) in store.events
    assert ("remove", stale) in store.events
    assert ("remove", record_fdname(SHARE.share_id, 2)) not in store.events  # the adopted share's record stays
    park(lot, share(1))  # generations go on after the newest found
    assert record_fdname(share(1).share_id, 3) in store.stored


def test_a_name_two_records_claim_goes_to_the_newer(store: RecordingStore) -> None:
    """A ``replace`` cut short by a kill: the new share's record was stored, the old one's not yet updated."""
    first = ParkingLot(store)
    park(first, share(0, 1000, "model", "other"))
    park(first, share(1, 1000, "model"))
    recovered = ParkingLot(store).recover(store.passed())
    by_id = {s.share_id: [n.name for n in s.names] for s, _ in recovered.shares}
    assert by_id == {share(0).share_id: ["other"], share(1).share_id: ["model"]}
    for _, fd in recovered.shares:
        os.close(fd)


def test_a_names_copies_on_other_devices_do_not_compete(store: RecordingStore) -> None:
    """A name holds one copy per device: each device's newest record keeps the name there."""
    first = ParkingLot(store)
    park(first, replace(share(0, 1000, "model"), device=0, device_uuid="GPU-a"))
    park(first, replace(share(1, 1000, "model"), device=1, device_uuid="GPU-b"))
    park(first, replace(share(2, 1000, "model", "b-too"), device=1, device_uuid="GPU-b"))
    recovered = ParkingLot(store).recover(store.passed())
    by_id = {s.share_id: [n.name for n in s.names] for s, _ in recovered.shares}
    assert by_id == {share(0).share_id: ["model"], share(2).share_id: ["model", "b-too"]}
    for _, fd in recovered.shares:
        os.close(fd)


def test_a_format_1_registry_is_recovered_and_rewritten_as_records(store: RecordingStore) -> None:
    raw = encode_registry([SHARE], 9)
    registry = sealed_memfd("registry", len(raw))
    os.pwrite(registry, raw, 0)
    memory = sealed_memfd("share", 4096)
    lot = ParkingLot(store)
    recovered = lot.recover([("cuctxd-registry-9", registry), (SHARE.fdname, memory)])
    assert [s for s, _ in recovered.shares] == [SHARE]
    lot.adopted(SHARE, recovered.shares[0][1])
    os.close(recovered.shares[0][1])
    lot.commit()
    assert store.events[-2:] == [("store", record_fdname(SHARE.share_id, 10)), ("remove", "cuctxd-registry-9")]
