"""A persistent publish parks its share before it answers, or fails with NotParked and names nothing: the publish
handler against a sim DeviceState (the test thread plays the worker) and a store that can refuse."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.registry.parking import ParkingLot
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.errors import NotFound, NotParked
from tests.unit.daemon.device.test_data_plane_state import MEMORY
from tests.unit.daemon.device.test_device_state import MAX_PAYLOAD, new_ref, run


@dataclass
class FailingStore:
    """An fd store whose datagrams fail while ``failing`` (the service manager's socket gone)."""

    limit: int | None = 64
    failing: bool = False
    stored: dict[str, int] = field(default_factory=dict)

    def store(self, name: str, fd: int) -> bool:
        if self.failing:
            return False
        self.stored[name] = os.dup(fd)
        return True

    def remove(self, name: str) -> bool:
        fd = self.stored.pop(name, None)
        if fd is not None:
            os.close(fd)
        return not self.failing

    def close(self) -> None:
        for fd in self.stored.values():
            os.close(fd)


@pytest.fixture
def store() -> Iterator[FailingStore]:
    failing = FailingStore()
    yield failing
    failing.close()


@pytest.fixture
def state(store: FailingStore) -> DeviceState:
    driver = SimDriver(device_count=1, memory_per_device=MEMORY)
    driver.init()
    registry = ShareRegistry()
    registry.parking = ParkingLot(store)
    return DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=MAX_PAYLOAD), registry, TicketBook())


def test_a_persistent_publish_the_store_refuses_names_nothing(state: DeviceState, store: FailingStore) -> None:
    ref = new_ref(uid=1000)
    buffer = run(state, ref, "alloc", size=4096, shareable=True).result["buffer"]["handle"]
    run(state, ref, "publish", buffer=buffer, name="plain")  # not persistent: nothing to park
    store.failing = True
    with pytest.raises(NotParked, match="did not take"):
        run(state, ref, "publish", buffer=buffer, name="weights", persistent=True)
    with pytest.raises(NotFound):
        state.registry.lookup("weights")
    assert state.registry.lookup("plain").size == 4096
    (share,) = state.sharing.shares.values()
    assert not share.persistent and store.stored == {}

    store.failing = False
    run(state, ref, "publish", buffer=buffer, name="weights", persistent=True)
    assert share.persistent and sorted(name.split("-")[1] for name in store.stored) == ["record", "share"]
    assert state.registry.parking is not None and state.registry.parking.parked(share.share_id) is not None


def test_a_uid_past_its_share_is_refused_before_anything_is_named(state: DeviceState, store: FailingStore) -> None:
    store.limit = 8  # a quarter: 2 fds, one share
    state.registry.parking = ParkingLot(store)
    ref = new_ref(uid=1000)
    first, second = (run(state, ref, "alloc", size=4096, shareable=True).result["buffer"]["handle"] for _ in "ab")
    run(state, ref, "publish", buffer=first, name="first", persistent=True)
    with pytest.raises(NotParked, match="max_parked_fds_per_uid: uid 1000 has 2 fds"):
        run(state, ref, "publish", buffer=second, name="second", persistent=True)
    with pytest.raises(NotFound):
        state.registry.lookup("second")
