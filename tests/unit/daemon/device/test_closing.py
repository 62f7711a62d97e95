"""A session's close on a DeviceState: linear in what it held, and in chunks the worker runs between requests.

The test thread plays the device worker, as in test_device_state.py.
"""

from __future__ import annotations

import time

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.state import CLOSE_CHUNK, DeviceState
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook


def _state_with_contexts(count: int) -> tuple[DeviceState, SessionRef]:
    driver = SimDriver(device_count=1, memory_per_device=1 << 20)
    driver.init()
    limits = DeviceLimits(max_payload=4096, max_contexts_per_session=0)  # thousands of contexts, on purpose
    state = DeviceState(driver, 0, driver.device_info(0), limits, ShareRegistry(), TicketBook())
    ref = SessionRef("token", 1, "unit", 1)
    session = state.session(ref)
    for _ in range(count):
        state.contexts.create(session, 0)
    state.memory.alloc(session, state.contexts.current_or_primary(session), 64, False)
    return state, ref


def _close_timed(count: int) -> tuple[float, float, int]:
    """Total seconds to close a session of ``count`` contexts, the longest chunk, and the chunks run."""
    state, ref = _state_with_contexts(count)
    start = time.perf_counter()
    state.close_session(ref)
    slowest, chunks = time.perf_counter() - start, 1
    while state.closing:
        began = time.perf_counter()
        state.close_more()
        slowest, chunks = max(slowest, time.perf_counter() - began), chunks + 1
    return time.perf_counter() - start, slowest, chunks


def test_closing_takes_time_linear_in_the_contexts_held() -> None:
    small, _, _ = _close_timed(2_000)
    large, _, _ = _close_timed(16_000)
    # 8 times the contexts: linear is ~8x, quadratic ~64x (it was: 2,000 took 0.15 s, 8,000 took 2 s).
    assert large < 20 * max(small, 0.005), f"2,000 contexts closed in {small:.3f} s, 16,000 in {large:.3f} s"


def test_a_large_close_runs_in_chunks_and_leaves_nothing() -> None:
    state, ref = _state_with_contexts(3 * CLOSE_CHUNK)
    state.close_session(ref)
    assert ref.token not in state.sessions  # gone at once: no request can name it any more
    assert len(state.closing) == 1
    chunks = 1
    while state.closing:
        state.close_more()
        chunks += 1
    assert chunks >= 3
    assert state.live_contexts() == []
    assert state.contexts.primary_refs == 0


def test_a_small_close_finishes_at_once() -> None:
    state, ref = _state_with_contexts(10)
    state.close_session(ref)
    assert not state.closing
    assert state.contexts.primary_refs == 0
