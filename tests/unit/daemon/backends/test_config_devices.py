"""``devices = [...]``: serving some driver ordinals, renumbered 0..n-1, through :class:`DeviceSubset`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.backends.subset import DeviceSubset
from cuctxd.protos.errors import CudaError

MiB = 1 << 20


@pytest.fixture
def sim() -> Iterator[Driver]:
    driver = SimDriver(device_count=3, memory_per_device=8 * MiB)
    driver.init()
    yield driver


def test_only_the_chosen_ordinals_are_seen_in_the_chosen_order(sim: Driver) -> None:
    subset = DeviceSubset.wrap(sim, [2, 0])
    assert subset.device_count() == 2
    assert [subset.device_info(i).index for i in range(2)] == [0, 1]
    assert subset.device_info(0).uuid == sim.device_info(2).uuid
    assert subset.device_info(1).pci_bus_id == sim.device_info(0).pci_bus_id
    assert subset.name == sim.name


def test_calls_with_an_ordinal_reach_the_physical_device_and_come_back_renumbered(sim: Driver) -> None:
    subset = DeviceSubset.wrap(sim, [2, 0])
    ctx = subset.primary_ctx_retain(0)
    try:
        assert sim.primary_ctx_state(2)[1] is True
        assert sim.primary_ctx_state(0)[1] is False
        assert subset.primary_ctx_state(ordinal=0)[1] is True
        subset.ctx_set_current(ctx)
        assert subset.ctx_get_device() == 0
        assert sim.ctx_get_device() == 2
        subset.ctx_set_current(None)
    finally:
        subset.primary_ctx_release(0)
    created = subset.ctx_create(0, 1)
    try:
        assert subset.ctx_get_device() == 1
    finally:
        subset.ctx_destroy(created)


def test_an_index_past_the_subset_is_an_invalid_device(sim: Driver) -> None:
    subset = DeviceSubset.wrap(sim, [1])
    with pytest.raises(CudaError) as error:
        subset.device_info(1)
    assert error.value.name == "CUDA_ERROR_INVALID_DEVICE"


def test_an_ordinal_the_driver_does_not_have_is_refused(sim: Driver) -> None:
    with pytest.raises(ValueError, match="no device with ordinal 3"):
        DeviceSubset(sim, [0, 3])
