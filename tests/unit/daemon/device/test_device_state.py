"""DeviceState and the device handlers against a plain SimDriver, on the test's own thread.

Here the test thread plays the device worker: it builds the state, owns it and
is the only caller, as a worker would be.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import Buffer, DeviceLimits, SessionOnDevice, check_range
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.status import device_status
from cuctxd.daemon.device.streams import STAGED_READ_MAX
from cuctxd.daemon.handlers import DEVICE_HANDLERS
from cuctxd.daemon.handlers.replies import Forward, Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.errors import CudaError, OutOfRange, TooLarge, UnknownHandle
from cuctxd.protos.schema import OPS, decode_args
from tests.helpers import wait_until

MEMORY = 1 << 20
MAX_PAYLOAD = 4096

_ids = itertools.count(1)


def new_ref(uid: int | None = None) -> SessionRef:
    n = next(_ids)
    return SessionRef(token=f"token-{n}", public_id=n, client="unit", pid=n, uid=uid)


@pytest.fixture
def driver() -> Iterator[SimDriver]:
    sim = SimDriver(device_count=2, memory_per_device=MEMORY)
    sim.init()
    yield sim


@pytest.fixture
def state(driver: SimDriver) -> DeviceState:
    limits = DeviceLimits(max_payload=MAX_PAYLOAD, primary_keep=0.0)  # the primary goes with its last user
    return DeviceState(driver, 0, driver.device_info(0), limits, ShareRegistry(), TicketBook())


def run(state: DeviceState, ref: SessionRef, op: str, payload: tuple[Any, ...] = (), **args: Any) -> Any:
    """Run a device handler as the worker would, finishing any Forward on the same state."""
    job = Job(b"peer", 1, OPS[op], decode_args(OPS[op], args), ref, state.device, payload)
    outcome = DEVICE_HANDLERS[op](state, job)
    while isinstance(outcome, Forward | Pending):
        if isinstance(outcome, Forward):
            outcome = outcome.then(state)
        else:
            assert wait_until(outcome.done, timeout=10), f"{op} never completed"
            outcome = outcome.then()
    assert isinstance(outcome, Reply)
    return outcome


def alloc(state: DeviceState, session: SessionOnDevice, size: int, *, shareable: bool) -> Buffer:
    """As the alloc handler does: in the session's current context (or the primary)."""
    return state.memory.alloc(session, state.contexts.for_new(session, "buffer"), size, shareable)


# --- the context stack -------------------------------------------------------------------


def test_a_new_session_has_an_empty_stack(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    assert session.stack == []
    assert state.contexts.top(session) is None
    assert session.primary is None
    assert driver.primary_ctx_state(0) == (0, False)
    assert run(state, session.ref, "current_context").result == {"context": None}
    assert run(state, session.ref, "context_stack").result == {"stack": [], "depth": 0, "truncated": False}


def test_current_or_primary_binds_the_primary_lazily_once(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    primary = state.contexts.current_or_primary(session)
    assert primary.is_primary
    assert session.stack == [primary]
    assert session.primary is primary
    assert driver.primary_ctx_state(0)[1] is True
    assert state.contexts.current_or_primary(session) is primary
    assert session.stack == [primary]
    assert device_status(state)["primary_context"]["references"] == 1


def test_set_device_replaces_the_top_of_the_stack(state: DeviceState) -> None:
    session = state.session(new_ref())
    first = state.contexts.create(session, 0)
    second = state.contexts.create(session, 0)
    primary = state.contexts.set_device(session)
    assert primary.is_primary
    assert session.stack == [first, primary]
    assert second.handle in session.contexts  # replaced, not destroyed
    assert state.contexts.set_device(session) is primary
    assert session.stack == [first, primary]


def test_set_device_on_an_empty_stack_pushes_the_primary(state: DeviceState) -> None:
    session = state.session(new_ref())
    primary = state.contexts.set_device(session)
    assert session.stack == [primary]


def test_create_pushes_a_new_current_context(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    primary = state.contexts.set_device(session)
    created = state.contexts.create(session, 0)
    assert not created.is_primary
    assert session.stack == [primary, created]
    assert state.contexts.top(session) is created
    assert created.context_id != primary.context_id
    assert created.handle != primary.handle
    assert driver.ctx_get_current() is created.ctx


def test_push_and_pop_through_the_handlers(state: DeviceState) -> None:
    session = state.session(new_ref())
    created = state.contexts.create(session, 0)
    pushed = run(state, session.ref, "push_context", context=created.handle).result["context"]
    assert pushed["handle"] == created.handle
    assert [c.handle for c in session.stack] == [created.handle, created.handle]
    assert run(state, session.ref, "pop_context").result["context"]["handle"] == created.handle
    assert run(state, session.ref, "pop_context").result["context"]["handle"] == created.handle
    with pytest.raises(CudaError) as info:
        run(state, session.ref, "pop_context")
    assert info.value.name == "CUDA_ERROR_INVALID_CONTEXT"


def test_destroy_frees_its_buffers_and_leaves_the_stack(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    primary = state.contexts.set_device(session)
    kept = alloc(state, session, 4096, shareable=False)
    created = state.contexts.create(session, 0)
    state.session(session.ref).stack.append(created)  # on the stack twice
    doomed = [alloc(state, session, 4096, shareable=False), alloc(state, session, 8192, shareable=False)]
    assert device_status(state)["sessions"][0]["allocations"] == 3
    assert session.bytes_allocated == 4096 + 4096 + 8192
    state.activate(primary)
    free_before = driver.mem_get_info()[0]
    state.destroy_context(session, created.handle)
    assert session.stack == [primary]
    assert created.handle not in session.contexts
    assert set(session.buffers) == {kept.handle}
    assert session.bytes_allocated == 4096
    state.activate(primary)
    assert driver.mem_get_info()[0] == free_before + 4096 + 8192
    for buffer in doomed:
        with pytest.raises(UnknownHandle):
            session.buffers[buffer.handle]
    with pytest.raises(UnknownHandle):
        state.destroy_context(session, created.handle)
    with pytest.raises(UnknownHandle):
        run(state, session.ref, "context_info", context=created.handle)


def test_destroying_the_primary_is_invalid_context(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    primary = state.contexts.set_device(session)
    with pytest.raises(CudaError) as info:
        state.destroy_context(session, primary.handle)
    assert info.value.name == "CUDA_ERROR_INVALID_CONTEXT"
    assert session.stack == [primary]
    assert driver.primary_ctx_state(0)[1] is True


def test_context_info_reports_the_driver_view(state: DeviceState) -> None:
    session = state.session(new_ref())
    created = state.contexts.create(session, 0x01)
    info = run(state, session.ref, "context_info", context=created.handle).result["context"]
    assert info["flags"] == 0x01
    assert info["device"] == 0
    assert info["is_primary"] is False
    assert info["api_version"] == 3020


# --- closing sessions ------------------------------------------------------------------


def test_close_session_frees_everything_and_releases_the_primary(state: DeviceState, driver: SimDriver) -> None:
    ref = new_ref()
    session = state.session(ref)
    alloc(state, session, 100_000, shareable=False)  # in the primary
    state.contexts.create(session, 0)
    alloc(state, session, 200_000, shareable=False)  # in the created context
    assert driver.primary_ctx_state(0)[1] is True
    state.close_session(ref)
    assert ref.token not in state.sessions
    assert driver.primary_ctx_state(0)[1] is False
    status = device_status(state)
    assert status["primary_context"]["active"] is False
    assert status["primary_context"]["references"] == 0
    assert status["primary_context"]["kept_for"] is None, "primary_keep 0: not kept at all"
    assert status["sessions"] == []
    assert status["contexts"] == []
    assert state.live_contexts() == []
    # Nothing is left allocated on the device: a new session sees all of it free.
    other = state.session(new_ref())
    state.activate(state.contexts.current_or_primary(other))
    assert driver.mem_get_info() == (MEMORY, MEMORY)


def test_close_session_keeps_the_primary_active_while_another_session_holds_it(
    state: DeviceState, driver: SimDriver
) -> None:
    a, b = new_ref(), new_ref()
    alloc(state, state.session(a), 4096, shareable=False)
    b_buffer = alloc(state, state.session(b), 4096, shareable=False)
    run(state, b, "write", (b"kept by b",), buffer=b_buffer.handle)
    assert device_status(state)["primary_context"]["references"] == 2
    state.close_session(a)
    assert driver.primary_ctx_state(0)[1] is True
    assert device_status(state)["primary_context"]["references"] == 1
    assert run(state, b, "read", buffer=b_buffer.handle, size=9).frames[0] == b"kept by b"
    state.close_session(b)
    assert driver.primary_ctx_state(0)[1] is False


def test_the_primary_can_be_bound_again_after_the_last_release(state: DeviceState, driver: SimDriver) -> None:
    first = new_ref()
    old_id = state.contexts.set_device(state.session(first)).context_id
    state.close_session(first)
    second = state.session(new_ref())
    primary = state.contexts.set_device(second)
    assert driver.primary_ctx_state(0)[1] is True
    assert primary.context_id != old_id
    buffer = alloc(state, second, 16, shareable=False)
    run(state, second.ref, "fill", buffer=buffer.handle, value=7)
    assert run(state, second.ref, "read", buffer=buffer.handle).frames[0] == b"\x07" * 16


def test_closing_an_unknown_session_is_a_no_op(state: DeviceState) -> None:
    state.close_session(new_ref())
    assert state.sessions == {}


# --- memory ----------------------------------------------------------------------------


def test_free_returns_memory_and_invalidates_the_handle(state: DeviceState, driver: SimDriver) -> None:
    session = state.session(new_ref())
    state.activate(state.contexts.current_or_primary(session))
    before = driver.mem_get_info()[0]
    buffer = alloc(state, session, 65536, shareable=False)
    assert driver.mem_get_info()[0] == before - 65536
    state.memory.free(session, session.buffers[buffer.handle], unpublish=True)
    assert driver.mem_get_info()[0] + state.pools.cached() == before  # pool memory stays cached for reuse
    with pytest.raises(UnknownHandle):
        state.memory.free(session, session.buffers[buffer.handle], unpublish=True)


def test_handles_are_scoped_to_their_session(state: DeviceState) -> None:
    a, b = state.session(new_ref()), state.session(new_ref())
    buffer = alloc(state, a, 64, shareable=False)
    context = state.contexts.create(a, 0)
    with pytest.raises(UnknownHandle):
        b.buffers[buffer.handle]
    with pytest.raises(UnknownHandle):
        state.destroy_context(b, context.handle)
    assert b.stack == []


def test_memory_handlers_move_real_bytes(state: DeviceState) -> None:
    ref = new_ref()
    src = run(state, ref, "alloc", size=64).result["buffer"]["handle"]
    dst = run(state, ref, "alloc", size=64).result["buffer"]["handle"]
    run(state, ref, "fill", buffer=src, value=0xAA)
    assert run(state, ref, "write", (b"hello",), buffer=src, offset=10).result == {"size": 5}
    assert run(state, ref, "copy", src=src, dst=dst, size=20, src_offset=5, dst_offset=40).result == {"size": 20}
    data = bytes(run(state, ref, "read", buffer=dst).frames[0])
    assert data == bytes(40) + b"\xaa" * 5 + b"hello" + b"\xaa" * 10 + bytes(4)


def test_read_beyond_the_payload_limit_is_too_large(state: DeviceState) -> None:
    ref = new_ref()
    handle = run(state, ref, "alloc", size=MAX_PAYLOAD + 1).result["buffer"]["handle"]
    with pytest.raises(TooLarge):
        run(state, ref, "read", buffer=handle)
    assert len(run(state, ref, "read", buffer=handle, size=MAX_PAYLOAD).frames[0]) == MAX_PAYLOAD


@pytest.mark.parametrize("op", ["fill", "read"])
def test_out_of_range_handlers(state: DeviceState, op: str) -> None:
    ref = new_ref()
    handle = run(state, ref, "alloc", size=32).result["buffer"]["handle"]
    with pytest.raises(OutOfRange):
        run(state, ref, op, buffer=handle, offset=16, size=17)
    with pytest.raises(OutOfRange):
        run(state, ref, op, buffer=handle, offset=33)


# --- check_range -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "size", "expected"),
    [(0, None, 100), (0, 100, 100), (40, None, 60), (100, None, 0), (100, 0, 0), (99, 1, 1), (0, 0, 0)],
)
def test_check_range_accepts_ranges_inside_the_buffer(offset: int, size: int | None, expected: int) -> None:
    assert check_range(100, offset, size) == expected


@pytest.mark.parametrize(
    ("offset", "size"),
    [(101, None), (101, 0), (0, 101), (50, 51), (100, 1), (1 << 62, 1), (1, (1 << 63) - 1)],
)
def test_check_range_rejects_ranges_outside_the_buffer(offset: int, size: int | None) -> None:
    with pytest.raises(OutOfRange) as info:
        check_range(100, offset, size)
    assert info.value.name == "CUCTXD_ERROR_OUT_OF_RANGE"


def test_pool_memory_is_cached_after_free_and_trimmed_when_the_session_ends(
    state: DeviceState, driver: SimDriver
) -> None:
    ref = new_ref()
    session = state.session(ref)
    state.activate(state.contexts.current_or_primary(session))
    other = state.session(new_ref())  # keeps the primary (and its pool) alive
    state.contexts.bind_primary(other)
    before = driver.mem_get_info()[0]
    buffer = alloc(state, session, 65536, shareable=False)
    state.memory.free(session, session.buffers[buffer.handle], unpublish=True)
    assert driver.mem_get_info()[0] <= before  # cached by the pool, as CUDA's pools do
    again = alloc(state, session, 65536, shareable=False)
    assert again.ptr == buffer.ptr or driver.mem_get_info()[0] <= before
    state.close_session(ref)
    assert driver.mem_get_info()[0] == before


def test_small_reads_share_a_staging_buffer_per_context_freed_with_it(driver: SimDriver) -> None:
    limits = DeviceLimits(max_payload=4 * STAGED_READ_MAX)
    state = DeviceState(driver, 0, driver.device_info(0), limits, ShareRegistry(), TicketBook())
    session = state.session(new_ref())
    created = state.contexts.create(session, 0)
    state.session(session.ref).stack.append(created)
    pattern = bytes(range(256)) * (2 * STAGED_READ_MAX // 256)
    handle = run(state, session.ref, "alloc", size=len(pattern)).result["buffer"]["handle"]
    run(state, session.ref, "write", (pattern,), buffer=handle)
    assert bytes(run(state, session.ref, "read", buffer=handle, offset=3, size=100).frames[0]) == pattern[3:103]
    staging = state.streams.read_staging[created.context_id]
    assert bytes(run(state, session.ref, "read", buffer=handle, size=STAGED_READ_MAX).frames[0]) == \
        pattern[:STAGED_READ_MAX]
    assert state.streams.read_staging[created.context_id] is staging  # made once, reused
    assert bytes(run(state, session.ref, "read", buffer=handle).frames[0]) == pattern  # larger: not staged
    state.destroy_context(session, created.handle)
    assert created.context_id not in state.streams.read_staging
    with pytest.raises(CudaError):  # already freed with the context's objects
        driver.mem_free_host(staging)


def test_the_primary_is_kept_for_primary_keep_and_taken_over_by_the_next_session(
        driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    unregistered: list[int] = []
    unregister = driver.host_unregister
    monkeypatch.setattr(driver, "host_unregister", lambda view: unregistered.append(len(view)) or unregister(view))
    state = DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=MAX_PAYLOAD, primary_keep=30.0),
                        ShareRegistry(), TicketBook())
    first = new_ref()
    kept_id = state.contexts.set_device(state.session(first)).context_id
    alloc(state, state.session(first), 100_000, shareable=False)
    state.close_session(first)
    assert driver.primary_ctx_state(0)[1] is True, "the daemon keeps it"
    assert device_status(state)["primary_context"]["references"] == 0
    assert 29 < device_status(state)["primary_context"]["kept_for"] <= 30
    assert device_status(state)["memory"]["allocated"] == 0, "the closed session's memory is freed while kept"
    second = new_ref()
    primary = state.contexts.set_device(state.session(second))
    assert primary.context_id == kept_id and state.contexts.kept is None
    assert kept_id not in state.streams.ended_contexts, "its markers and host buffers count again"
    host = run(state, second, "host_alloc", size=4096).result["host"]
    buffer = run(state, second, "alloc", size=4096).result["buffer"]
    stream = run(state, second, "create_stream").result["stream"]
    run(state, second, "memcpy_htod", buffer=buffer["handle"], host=host, stream=stream)
    run(state, second, "host_free", host=host)
    assert unregistered == [4096], "the host buffer was unregistered in the kept context"
    state.close_session(second)
    state.contexts.release_kept(time.monotonic() + 10)
    assert driver.primary_ctx_state(0)[1] is True, "kept until primary_keep has passed"
    state.contexts.release_kept(time.monotonic() + 31)
    assert driver.primary_ctx_state(0)[1] is False and device_status(state)["primary_context"]["kept_for"] is None
    third = state.session(new_ref())
    assert state.contexts.set_device(third).context_id != kept_id, "made anew once released"
