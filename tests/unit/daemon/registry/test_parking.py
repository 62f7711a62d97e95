"""The parked registry's format and the parking lot's bookkeeping against a store that records what it is sent."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pytest

from cuctxd.daemon.registry.parking import (
    FORMAT_VERSION,
    ParkedName,
    ParkedShare,
    ParkError,
    ParkingLot,
    decode,
    encode,
)
from cuctxd.protos.memfd import sealed_memfd

SHARE = ParkedShare("ab" * 16, 0, "GPU-0", 4096, "sim", "pool", bytes(range(64)),
                    (ParkedName("model", b"\x81\xa1a\x01", 3, True), ParkedName("alias")),
                    {"session": 7, "client": "loader", "pid": 42, "uid": 1000})


@dataclass
class RecordingStore:
    """Keeps a copy of every fd stored, by name, as systemd would."""

    limit: int | None = None
    stored: dict[str, list[int]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    def store(self, name: str, fd: int) -> bool:
        self.stored.setdefault(name, []).append(os.dup(fd))
        return True

    def remove(self, name: str) -> bool:
        self.removed.append(name)
        for fd in self.stored.pop(name, []):
            os.close(fd)
        return True

    def close(self) -> None:
        for fds in self.stored.values():
            for fd in fds:
                os.close(fd)


@pytest.fixture
def store() -> RecordingStore:
    recording = RecordingStore()
    yield recording  # type: ignore[misc]
    recording.close()


def test_a_registry_decodes_to_what_was_encoded() -> None:
    assert decode(encode([SHARE], 5)) == (5, [SHARE])


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{", json.dumps({"format": FORMAT_VERSION + 1, "generation": 1, "shares": []}).encode(),
    json.dumps({"generation": 1, "shares": []}).encode(),
    encode([SHARE], 1).replace(b'"size":4096', b'"size":"4096"'),
    encode([SHARE], 1).replace(b'"mechanism":"pool"', b'"mechanism":"nvlink"'),
    encode([SHARE], 1).replace(b"ab" * 16, b"../etc"),
    encode([SHARE], 1)[:-10],
])
def test_what_cannot_be_verified_is_a_park_error(raw: bytes) -> None:
    with pytest.raises(ParkError):
        decode(raw)


def test_parking_stores_the_fd_and_the_next_registry_before_removing_the_last(store: RecordingStore) -> None:
    lot = ParkingLot(store)
    memory = sealed_memfd("share", 4096)
    try:
        assert lot.park(SHARE, memory)
    finally:
        os.close(memory)
    assert sorted(store.stored) == ["cuctxd-registry-1", SHARE.fdname]
    lot.update(ParkedShare(**{**SHARE.__dict__, "names": SHARE.names[:1]}))
    assert sorted(store.stored) == ["cuctxd-registry-2", SHARE.fdname]
    assert store.removed == ["cuctxd-registry-1"]
    lot.unpark(SHARE.share_id)
    assert store.stored == {} and store.removed[-2:] == [SHARE.fdname, "cuctxd-registry-2"]


def test_recovery_pairs_entries_with_their_fds_and_drops_the_rest(store: RecordingStore) -> None:
    first = ParkingLot(store)
    memory = sealed_memfd("share", 4096)
    first.park(SHARE, memory)
    os.close(memory)
    passed = [(name, os.dup(fds[0])) for name, fds in store.stored.items()]
    passed.append(("cuctxd-share-" + "cd" * 16, os.dup(passed[0][1])))
    recovered = ParkingLot(store).recover(passed)
    assert [share for share, _ in recovered.shares] == [SHARE]
    for _, fd in recovered.shares:
        os.close(fd)
    assert recovered.skipped == 1 and "cuctxd-share-" + "cd" * 16 in store.removed


def test_a_full_store_parks_nothing_more(store: RecordingStore) -> None:
    store.limit = 2  # both slots go to the registry
    memory = sealed_memfd("share", 4096)
    try:
        assert not ParkingLot(store).park(SHARE, memory)
    finally:
        os.close(memory)
    assert store.stored == {}
