"""The ``driver`` fixture: every contract test runs once per backend.

``sim`` always runs. ``cuda`` runs only where the NVIDIA driver loads and sees a
device; elsewhere it is skipped with the reason (``-ra`` prints it). A test must
leave the driver as it found it: no context current on the test's thread and each
device's primary context as active as before. The fixture checks that after
every test, so a leak fails the test that caused it, not a later one.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

from cuctxd.daemon.backends.base import Driver
from tests.helpers import cuda_unavailable_reason

#: Simulated devices, so that multi-device tests run on the sim too.
SIM_DEVICES = 2
SIM_MEMORY = 256 << 20


@cache
def _cuda_driver() -> Driver:
    """One CudaDriver for the session: the real driver's state is process-wide anyway."""
    from cuctxd.daemon.backends.cuda import CudaDriver

    driver = CudaDriver()
    driver.init()
    return driver


def _make_driver(backend: str) -> Driver:
    if backend == "sim":
        from cuctxd.daemon.backends.sim import SimDriver

        sim = SimDriver(device_count=SIM_DEVICES, memory_per_device=SIM_MEMORY)
        sim.init()
        return sim
    reason = cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda backend: {reason}")
    return _cuda_driver()


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """An initialised driver of each backend, checked for leaked contexts afterwards. The thread's stack is
    compared with what it held before the test (a framework that ran earlier in this process, torch say,
    leaves its primary context current)."""
    backend = _make_driver(request.param)
    primaries = [backend.primary_ctx_state(ordinal)[1] for ordinal in range(backend.device_count())]
    current = backend.ctx_get_current()
    yield backend
    leaked = []
    while backend.ctx_get_current() not in (None, current):
        leaked.append(backend.ctx_pop())
    assert not leaked, f"the test left contexts on its thread's stack: {leaked}"
    assert backend.ctx_get_current() == current, "the test popped a context it did not push"
    after = [backend.primary_ctx_state(ordinal)[1] for ordinal in range(backend.device_count())]
    assert after == primaries, f"primary contexts active before {primaries}, after {after}"


@pytest.fixture
def cuda_bindings() -> Any:
    """``cuda.bindings.driver``, initialised; skips where the NVIDIA driver cannot run."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda backend: {reason}")
    from cuda.bindings import driver as cu

    return cu
