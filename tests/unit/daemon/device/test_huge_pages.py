"""2 MiB pages under a new host buffer's memfd (daemon/device/huge_pages.py): whole 2 MiB pages collapsed
through an aligned mapping that is gone again, the memfd still zero and of its size; a refusal leaves a
working buffer of small pages; ``host_alloc`` says how many of its bytes are in 2 MiB pages, a kept buffer
too; the collapse runs off the worker (other sessions go on meanwhile), a buffer being made counts as an
object already, and a session that closes meanwhile leaves nothing behind."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import platform
import re
import threading
from pathlib import Path

import pytest

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device import huge_pages
from cuctxd.daemon.device.huge_pages import HUGE_PAGE, collapse
from cuctxd.daemon.device.status import device_status
from cuctxd.daemon.handlers import DEVICE_HANDLERS
from cuctxd.daemon.handlers.replies import Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos.errors import LimitExceeded, SessionClosed
from cuctxd.protos.memfd import resize_sealed, sealed_memfd
from cuctxd.protos.schema import OPS, decode_args
from tests.helpers import wait_until
from tests.unit.daemon.device.test_device_state import driver, new_ref, run
from tests.unit.daemon.device.test_kept_host_buffers import make_state

__all__ = ["driver"]  # the fixture, shared


def _why_no_collapse() -> str | None:
    """Why this kernel cannot collapse shared memory (None where it can: Linux 6.1+, shmem not ``deny``)."""
    if platform.system() != "Linux":
        return "memfds and MADV_COLLAPSE are Linux's"
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    if found is None or (int(found[1]), int(found[2])) < (6, 1):
        return f"MADV_COLLAPSE came in Linux 6.1; this kernel is {platform.release()}"
    setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if not setting.exists():
        return "this kernel has no transparent huge pages"
    if "[deny]" in setting.read_text():
        return "shmem_enabled is deny"
    return None


needs_collapse = pytest.mark.skipif(_why_no_collapse() is not None, reason=str(_why_no_collapse()))


def _mappings_of(name: str) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if f"memfd:{name}" in line]


@needs_collapse
def test_whole_2mib_pages_are_collapsed_and_the_memfd_stays_zero_sized_and_sealed() -> None:
    size = 2 * HUGE_PAGE + 7
    fd = sealed_memfd("cuctxd-test-huge", size)
    try:
        assert collapse(fd, size) == 2 * HUGE_PAGE
        assert _mappings_of("cuctxd-test-huge") == [], "the aligned mapping is gone again"
        assert os.fstat(fd).st_size == size and resize_sealed(fd)
        with mmap.mmap(fd, size) as shared:
            assert shared[:] == bytes(size), "new memory reads as zeroes, the byte written in each page too"
            shared[HUGE_PAGE - 3:HUGE_PAGE + 3] = b"across"
        assert os.pread(fd, 6, HUGE_PAGE - 3) == b"across", "one memory, whatever maps it"
    finally:
        os.close(fd)


def test_a_buffer_under_2mib_keeps_its_small_pages_untouched() -> None:
    fd = sealed_memfd("cuctxd-test-small", HUGE_PAGE - 1)
    try:
        assert collapse(fd, HUGE_PAGE - 1) == 0
        assert os.fstat(fd).st_blocks == 0, "no page made"
    finally:
        os.close(fd)


@needs_collapse
def test_a_refusal_leaves_small_pages_no_mapping_and_a_buffer_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    fd = sealed_memfd("cuctxd-test-refused", 2 * HUGE_PAGE)
    try:
        monkeypatch.setattr(huge_pages, "_MADV_COLLAPSE", -1)  # an advice the kernel does not know: EINVAL
        assert collapse(fd, 2 * HUGE_PAGE) == 0
        assert _mappings_of("cuctxd-test-refused") == []

        def no_memory(*_: object) -> int:
            raise OSError(errno.ENOMEM, "no memory")

        monkeypatch.setattr(huge_pages.os, "pwrite", no_memory)
        assert collapse(fd, 2 * HUGE_PAGE) == 0
        with mmap.mmap(fd, 2 * HUGE_PAGE) as shared:
            shared[-5:] = b"works"
            assert shared[:3] == bytes(3) and shared[-5:] == b"works"
    finally:
        os.close(fd)


@needs_collapse
def test_host_alloc_says_its_bytes_in_2mib_pages_and_a_kept_buffer_keeps_them(
        driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(driver, kept_host_memory=16 * HUGE_PAGE)
    first = new_ref(uid=1000)
    for size, huge in ((HUGE_PAGE // 2, 0), (3 * HUGE_PAGE + 5, 3 * HUGE_PAGE)):
        reply = run(state, first, "host_alloc", size=size, reuse=True).result
        assert reply["huge_page_bytes"] == huge
        os.close(state.tickets.redeem(reply["ticket"], first.uid)[0][0])
        run(state, first, "host_free", host=reply["host"])
    state.close_session(first)
    monkeypatch.setattr(huge_pages, "collapse", lambda fd, size: 0)  # new buffers get small pages from here
    second = new_ref(uid=1000)
    reply = run(state, second, "host_alloc", size=3 * HUGE_PAGE + 5, reuse=True).result
    assert reply["huge_page_bytes"] == 3 * HUGE_PAGE, "the kept buffer, as it was made"
    os.close(state.tickets.redeem(reply["ticket"], second.uid)[0][0])
    reply = run(state, second, "host_alloc", size=3 * HUGE_PAGE + 5, reuse=False).result
    assert reply["huge_page_bytes"] == 0
    os.close(state.tickets.redeem(reply["ticket"], second.uid)[0][0])


def _slow_collapse(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """New memfds wait for the returned event before their (real) collapse: a slow one, held open."""
    go = threading.Event()
    real = huge_pages.collapse

    def slow(fd: int, size: int) -> int:
        assert go.wait(10)
        return real(fd, size)

    monkeypatch.setattr(huge_pages, "collapse", slow)
    return go


def test_the_worker_serves_other_sessions_while_a_buffer_is_collapsed(
        driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(driver)
    go = _slow_collapse(monkeypatch)
    maker, other = new_ref(uid=1000), new_ref(uid=1001)
    job = Job(b"peer", 1, OPS["host_alloc"], decode_args(OPS["host_alloc"], {"size": 2 * HUGE_PAGE}), maker, 0, ())
    making = DEVICE_HANDLERS["host_alloc"](state, job)
    assert isinstance(making, Pending) and not making.done()
    assert device_status(state)["host_bytes"] == 2 * HUGE_PAGE, "its bytes count while it is made"
    buffer = run(state, other, "alloc", size=64).result["buffer"]["handle"]  # not behind the collapse
    run(state, other, "free", buffer=buffer)
    go.set()
    assert wait_until(making.done, timeout=10)
    reply = making.then()
    assert isinstance(reply, Reply) and reply.result["size"] == 2 * HUGE_PAGE
    os.close(state.tickets.redeem(reply.result["ticket"], maker.uid)[0][0])
    run(state, maker, "host_free", host=reply.result["host"])


def test_a_session_that_closes_while_its_buffer_is_made_leaves_nothing(
        driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(driver)
    budget = state.tickets.budget
    go = _slow_collapse(monkeypatch)
    ref = new_ref(uid=1000)
    gc.collect()
    open_before = len(os.listdir("/proc/self/fd"))
    job = Job(b"peer", 1, OPS["host_alloc"], decode_args(OPS["host_alloc"], {"size": 2 * HUGE_PAGE}), ref, 0, ())
    making = DEVICE_HANDLERS["host_alloc"](state, job)
    assert isinstance(making, Pending)
    state.close_session(ref)
    go.set()
    assert wait_until(making.done, timeout=10)
    with pytest.raises(SessionClosed, match="closed while its host buffer"):
        making.then()
    assert device_status(state)["host_bytes"] == 0 and budget.held_by(ref.token) == 0
    assert len(os.listdir("/proc/self/fd")) == open_before, "its memfd closed"
    assert state.sessions.get(ref.token) is None, "not brought back"


def test_buffers_still_being_made_count_against_max_objects_per_session(
        driver: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(driver, max_objects_per_session=2)
    go = _slow_collapse(monkeypatch)
    ref, bystander = new_ref(uid=1000), new_ref(uid=1001)
    job = Job(b"peer", 1, OPS["host_alloc"], decode_args(OPS["host_alloc"], {"size": 4096}), ref, 0, ())
    makings = [DEVICE_HANDLERS["host_alloc"](state, job) for _ in range(2)]  # pipelined: none answered yet
    assert all(isinstance(making, Pending) and not making.done() for making in makings)
    with pytest.raises(LimitExceeded, match="max_objects_per_session"):
        DEVICE_HANDLERS["host_alloc"](state, job)
    buffer = run(state, bystander, "alloc", size=64).result["buffer"]["handle"]  # another session is served
    run(state, bystander, "free", buffer=buffer)
    go.set()
    for making in makings:
        assert isinstance(making, Pending) and wait_until(making.done, timeout=10)
        reply = making.then()
        assert isinstance(reply, Reply)
        os.close(state.tickets.redeem(reply.result["ticket"], ref.uid)[0][0])
    assert device_status(state)["sessions"][0]["objects"] == 2, "made: counted once each"
