"""Freed host buffers kept registered (daemon/device/host_keep.py): handed again to a
``host_alloc`` with ``reuse`` of the same size and uid without page-locking anew, bounded by
``kept_host_memory``, ``KEEP_MOST`` and ``max_host_memory``, unregistered after ``primary_keep`` (before the
primary context they live in goes)."""

from __future__ import annotations

import gc
import os
import time

import pytest

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.host_keep import KEEP_FROM, KEEP_MOST, KEPT_PEER
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.status import device_status
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from tests.unit.daemon.device.test_device_state import MAX_PAYLOAD, driver, new_ref, run

__all__ = ["driver"]  # the fixture, shared

MIB = 1 << 20


@pytest.fixture
def calls(driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Sizes of every host_register and host_unregister the state makes."""
    seen: dict[str, list[int]] = {"register": [], "unregister": []}
    register, unregister = driver.host_register, driver.host_unregister
    monkeypatch.setattr(driver, "host_register", lambda view: seen["register"].append(len(view)) or register(view))
    monkeypatch.setattr(driver, "host_unregister",
                        lambda view: seen["unregister"].append(len(view)) or unregister(view))
    return seen


def make_state(driver: SimDriver, **limits: float) -> DeviceState:
    settings = {"primary_keep": 30.0, "kept_host_memory": 8 * MIB, **limits}
    return DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=MAX_PAYLOAD, **settings),
                       ShareRegistry(), TicketBook())


def host_alloc(state: DeviceState, ref: SessionRef, size: int, reuse: bool = True) -> tuple[int, int]:
    """The new host buffer's handle and the fd its ticket gives (the caller closes it)."""
    result = run(state, ref, "host_alloc", size=size, reuse=reuse).result
    fds, _ = state.tickets.redeem(result["ticket"], ref.uid)
    return result["host"], fds[0]


def kept(state: DeviceState) -> dict[str, int]:
    return dict(device_status(state)["host_kept"])


def test_a_freed_buffer_serves_the_next_reuse_of_its_size_and_uid_without_new_page_locking(
        driver: SimDriver, calls: dict[str, list[int]]) -> None:
    state = make_state(driver)
    first = new_ref(uid=1000)
    host, fd = host_alloc(state, first, 2 * MIB)
    os.pwrite(fd, b"left by the first session", 0)
    os.close(fd)
    run(state, first, "host_free", host=host)
    assert calls["unregister"] == [] and kept(state) == {"bytes": 2 * MIB, "buffers": 1}
    assert device_status(state)["host_bytes"] == 0, "a kept buffer is no session's"
    state.close_session(first)

    second = new_ref(uid=1000)
    again, fd = host_alloc(state, second, 2 * MIB)
    assert os.pread(fd, 25, 0) == b"left by the first session", "the same memory, as its last user left it"
    os.close(fd)
    assert calls["register"] == [2 * MIB], "no second page-locking"
    assert kept(state) == {"bytes": 0, "buffers": 0}
    assert device_status(state)["host_bytes"] == 2 * MIB
    run(state, second, "memcpy_htod", buffer=run(state, second, "alloc", size=64).result["buffer"]["handle"],
        host=again, size=64)

    for other, reuse in ((new_ref(uid=1001), True), (new_ref(uid=1000), False), (second, True)):
        _, fd = host_alloc(state, other, 2 * MIB, reuse)  # another uid; no reuse asked; none kept
        assert os.pread(fd, 25, 0) == bytes(25), "new memory is zeroed"
        os.close(fd)
    assert len(calls["register"]) == 4


def test_kept_buffers_go_after_primary_keep_before_the_primary_context(
        driver: SimDriver, calls: dict[str, list[int]]) -> None:
    state = make_state(driver)
    ref = new_ref(uid=1000)
    _, fd = host_alloc(state, ref, 2 * MIB)
    os.close(fd)
    state.close_session(ref)  # frees the host buffer (kept), then lets the primary go (kept)
    assert kept(state)["buffers"] == 1 and driver.primary_ctx_state(0)[1] is True
    state.host.kept.release(time.monotonic() + 10)
    assert kept(state)["buffers"] == 1, "kept until primary_keep has passed"
    later = time.monotonic() + 31
    state.host.kept.release(later)
    state.contexts.release_kept(later)
    assert calls["unregister"] == [2 * MIB] and kept(state)["buffers"] == 0
    assert driver.primary_ctx_state(0)[1] is False
    assert state.tickets.budget.held_by(KEPT_PEER) == 0


@pytest.mark.parametrize(("limits", "uid", "size"), [
    ({"primary_keep": 0.0}, 1000, 2 * MIB),  # CUDA's own behaviour: nothing outlives its user
    ({"kept_host_memory": 0}, 1000, 2 * MIB),
    ({}, None, 2 * MIB),  # a session whose uid is unknown
    ({}, 1000, KEEP_FROM - 1),
    ({}, 1000, 16 * MIB),  # larger than kept_host_memory
])
def test_what_is_not_kept(driver: SimDriver, calls: dict[str, list[int]], limits: dict[str, float],
                          uid: int | None, size: int) -> None:
    state = make_state(driver, **limits)
    ref = new_ref(uid=uid)
    host, fd = host_alloc(state, ref, size)
    os.close(fd)
    run(state, ref, "host_free", host=host)
    assert calls["unregister"] == [size] and kept(state)["buffers"] == 0


def test_the_keep_is_bounded_oldest_out_first(driver: SimDriver, calls: dict[str, list[int]]) -> None:
    state = make_state(driver, kept_host_memory=5 * MIB)
    ref = new_ref(uid=1000)
    handles = []
    for size in (2 * MIB, 3 * MIB, 1 * MIB):
        host, fd = host_alloc(state, ref, size)
        os.close(fd)
        handles.append(host)
    for host in handles:
        run(state, ref, "host_free", host=host)
    assert calls["unregister"] == [2 * MIB], "over kept_host_memory: the oldest went"
    assert kept(state) == {"bytes": 4 * MIB, "buffers": 2}
    assert state.tickets.budget.held_by(KEPT_PEER) == 4, "two fds each"
    handles = []
    for _ in range(KEEP_MOST + 1):
        host, fd = host_alloc(state, ref, 1 * MIB, reuse=False)
        os.close(fd)
        handles.append(host)
    for host in handles:
        run(state, ref, "host_free", host=host)
    assert kept(state) == {"bytes": KEEP_MOST * MIB, "buffers": KEEP_MOST}


def test_kept_buffers_make_room_under_max_host_memory(driver: SimDriver, calls: dict[str, list[int]]) -> None:
    state = make_state(driver, max_host_memory=7 * MIB)
    ref = new_ref(uid=1000)
    handles = []
    for size in (4 * MIB, 2 * MIB):
        host, fd = host_alloc(state, ref, size)
        os.close(fd)
        handles.append(host)
    for host in handles:
        run(state, ref, "host_free", host=host)
    assert kept(state)["bytes"] == 6 * MIB
    _, fd = host_alloc(state, ref, 3 * MIB)  # 6 kept + 3 > 7: the oldest kept one is unregistered for it
    os.close(fd)
    assert calls["unregister"] == [4 * MIB] and kept(state) == {"bytes": 2 * MIB, "buffers": 1}


def test_a_failing_dup_leaves_nothing_registered_open_or_charged(
        driver: SimDriver, calls: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(driver)
    ref = new_ref(uid=1000)
    host, fd = host_alloc(state, ref, 2 * MIB)
    os.close(fd)
    run(state, ref, "host_free", host=host)
    assert kept(state)["buffers"] == 1
    budget = state.tickets.budget
    held = budget.held_by(ref.token)
    gc.collect()  # earlier tests' unreachable mappings close their fds now, not during the count
    open_before = len(os.listdir("/proc/self/fd"))

    def no_fd_left(fd: int) -> int:
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(os, "dup", no_fd_left)
    for reuse in (True, False):  # the kept one handed out again; a new one made
        with pytest.raises(OSError, match="Too many open files"):
            host_alloc(state, ref, 2 * MIB, reuse)
    monkeypatch.undo()

    assert calls["register"] == [2 * MIB], "the new buffer failed before its page-locking"
    assert calls["unregister"] == [2 * MIB], "the kept one taken for the reuse was unregistered"
    assert kept(state) == {"bytes": 0, "buffers": 0}
    assert budget.held_by(ref.token) == held and budget.held_by(KEPT_PEER) == 0
    assert device_status(state)["host_bytes"] == 0
    assert len(os.listdir("/proc/self/fd")) == open_before - 2, "the kept one's memfd and mapping closed, none new"
    run(state, ref, "host_free", host=host_alloc(state, ref, 2 * MIB)[0])  # and the session goes on
