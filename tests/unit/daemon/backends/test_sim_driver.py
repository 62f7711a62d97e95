"""What only the sim backend promises: its configuration, addresses, strictness and threads.

Behaviour shared with the real driver is in ``tests/contract``; this file covers
what the contract cannot pin on a GPU (capacity accounting to the byte, address
layout, refusing what the driver leaves undefined, work held at a chosen point
with ``launch_host_func``) and the sim's own executor threads.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cuctxd.daemon.backends.base import Ctx, Event, Pool, Stream
from cuctxd.daemon.backends.sim import CU_CTX_MAP_HOST, SimDriver
from cuctxd.daemon.backends.sim_memory import (
    ALIGNMENT,
    GIL_FREE_SIZE,
    AddressSpace,
    Allocation,
    Storage,
    copy_bytes,
    fill_bytes,
)
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.host import buffer_address
from cuctxd.protos.memfd import resize_sealed
from cuctxd.protos.sim_ipc import decode_handle
from tests.helpers import raises_cuda

MIB = 1 << 20
CAPACITY = 8 * MIB


@pytest.fixture
def sim() -> Iterator[SimDriver]:
    """An initialised two-device sim; the test thread's stack must be empty afterwards."""
    driver = SimDriver(device_count=2, memory_per_device=CAPACITY)
    driver.init()
    yield driver
    assert driver.ctx_get_current() is None


@contextmanager
def created(sim: SimDriver, ordinal: int = 0) -> Iterator[Ctx]:
    ctx = sim.ctx_create(0, ordinal)
    try:
        yield ctx
    finally:
        sim.ctx_destroy(ctx)


def read(sim: SimDriver, ptr: int, size: int) -> bytes:
    out = bytearray(size)
    sim.memcpy_dtoh(memoryview(out), ptr, size)
    return bytes(out)


# --- configuration and initialisation -----------------------------------------------------


def test_calls_before_init_are_not_initialized() -> None:
    driver = SimDriver()
    for call in (
        driver.device_count,
        lambda: driver.device_info(0),
        lambda: driver.primary_ctx_retain(0),
        lambda: driver.ctx_create(0, 0),
        driver.ctx_get_current,
        driver.ctx_pop,
        lambda: driver.ctx_set_current(None),
        lambda: driver.mem_alloc(16),
    ):
        with raises_cuda("CUDA_ERROR_NOT_INITIALIZED"):
            call()
    driver.init()
    driver.init()  # cuInit may be called again
    assert driver.device_count() == 2


def test_no_devices_is_no_device_at_init() -> None:
    with raises_cuda("CUDA_ERROR_NO_DEVICE"):
        SimDriver(device_count=0).init()


@pytest.mark.parametrize(("devices", "memory"), [(-1, MIB), (17, MIB), (1, 0), (1, 1 << 40)])
def test_constructor_rejects_impossible_shapes(devices: int, memory: int) -> None:
    with pytest.raises(ValueError):
        SimDriver(device_count=devices, memory_per_device=memory)


def test_device_info_is_deterministic_and_configured(sim: SimDriver) -> None:
    info = sim.device_info(1)
    assert info.name == "cuctxd simulated GPU"
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", info.uuid)
    assert info.pci_bus_id == "0000:02:00.0"
    assert (info.compute_capability, info.multiprocessor_count) == ((9, 0), 132)
    assert info.total_memory == CAPACITY
    other = SimDriver(device_count=2, memory_per_device=CAPACITY)
    other.init()
    assert other.device_info(1).uuid == info.uuid != sim.device_info(0).uuid


# --- capacity ------------------------------------------------------------------------------


def test_capacity_is_exact_and_accounted_in_512_byte_units(sim: SimDriver) -> None:
    with created(sim):
        assert sim.mem_get_info() == (CAPACITY, CAPACITY)
        small = sim.mem_alloc(1)
        assert sim.mem_get_info()[0] == CAPACITY - ALIGNMENT
        with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
            sim.mem_alloc(CAPACITY)
        sim.mem_free(small)
        whole = sim.mem_alloc(CAPACITY)
        assert sim.mem_get_info()[0] == 0
        with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
            sim.mem_alloc(1)
        with created(sim, 1):
            assert sim.mem_get_info() == (CAPACITY, CAPACITY), "device 1 has its own memory"
        sim.mem_free(whole)
        assert sim.mem_get_info() == (CAPACITY, CAPACITY)


def test_last_primary_release_frees_its_memory(sim: SimDriver) -> None:
    primary = sim.primary_ctx_retain(0)
    sim.ctx_push(primary)
    ptr = sim.mem_alloc(MIB)
    assert sim.ctx_pop() == primary
    sim.primary_ctx_release(0)
    with created(sim):
        assert sim.mem_get_info()[0] == CAPACITY
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            read(sim, ptr, 1)


# --- addresses -----------------------------------------------------------------------------


def test_pointers_are_aligned_disjoint_and_per_device(sim: SimDriver) -> None:
    sizes = (1, 1, 1000, 513, 4096)
    with created(sim):
        zero = [sim.mem_alloc(size) for size in sizes]
        with created(sim, 1):
            one = sim.mem_alloc(1)
        assert all(ptr % ALIGNMENT == 0 for ptr in [*zero, one])
        assert zero[1] - zero[0] == ALIGNMENT
        for index in range(len(zero) - 1):
            assert zero[index] + sizes[index] <= zero[index + 1]
        assert abs(one - zero[0]) >= 1 << 40, "devices have far-apart address ranges"
        for ptr in zero:
            sim.mem_free(ptr)


def test_live_addresses_are_never_reused(sim: SimDriver) -> None:
    with created(sim):
        live = sim.mem_alloc(4096)
        seen = set()
        for _ in range(200):
            ptr = sim.mem_alloc(4096)
            assert ptr != live and ptr not in seen
            seen.add(ptr)
            sim.mem_free(ptr)
        sim.mem_free(live)


def test_address_space_wraps_around_to_freed_ranges() -> None:
    space = AddressSpace(device_count=1, span=4 * ALIGNMENT, base=1 << 20)

    def put(base: int | None) -> int:
        assert base is not None
        space.insert(Allocation(base, ALIGNMENT, ALIGNMENT, 0, _Owner(), Storage(1)))
        return base

    bases = [put(space.place(0, ALIGNMENT)) for _ in range(4)]
    assert bases == [(1 << 20) + i * ALIGNMENT for i in range(4)]
    assert space.place(0, ALIGNMENT) is None, "full"
    assert space.remove(bases[2]) is not None
    assert space.place(0, ALIGNMENT) == bases[2]
    assert space.place(0, 2 * ALIGNMENT) is None, "no two free neighbours"
    assert space.find(bases[1] + 100) is not None and space.find(bases[2]) is None


class _Owner:
    def __init__(self) -> None:
        self.allocations: set[int] = set()


def test_pointer_arithmetic_resolves_the_right_allocation(sim: SimDriver) -> None:
    with created(sim):
        ptrs = [sim.mem_alloc(1000) for _ in range(3)]
        for index, ptr in enumerate(ptrs):
            sim.memset_d8(ptr, index + 1, 1000)
            sim.memcpy_htod(ptr + 500, memoryview(bytes([0xF0 + index]) * 10), 10)
        for index, ptr in enumerate(ptrs):
            fill, mark = bytes([index + 1]), bytes([0xF0 + index])
            assert read(sim, ptr + 499, 12) == fill + mark * 10 + fill
            assert read(sim, ptr + 999, 1) == bytes([index + 1])
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                read(sim, ptr + 1000, 1)  # the padding up to the next 512 is not the allocation's
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            sim.mem_free(ptrs[0] + 1)
        for ptr in ptrs:
            sim.mem_free(ptr)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            read(sim, ptrs[1], 1)


def test_unified_addressing_except_device_to_device_across_devices(sim: SimDriver) -> None:
    with created(sim, 1):
        remote = sim.mem_alloc(64)
        with created(sim, 0):
            local = sim.mem_alloc(64)
            sim.memcpy_htod(remote, memoryview(b"r" * 64), 64)
            assert read(sim, remote, 64) == b"r" * 64
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                sim.memcpy_dtod(local, remote, 64)
            sim.mem_free(local)
        sim.mem_free(remote)


def test_overlapping_device_copy_behaves_like_memmove(sim: SimDriver) -> None:
    with created(sim):
        ptr = sim.mem_alloc(16)
        sim.memcpy_htod(ptr, memoryview(bytes(range(16))), 16)
        sim.memcpy_dtod(ptr + 4, ptr, 8)
        assert read(sim, ptr, 16) == bytes([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15])
        sim.mem_free(ptr)


def test_host_buffers_are_checked(sim: SimDriver) -> None:
    with created(sim):
        ptr = sim.mem_alloc(16)
        words = array("i", range(4))
        sim.memcpy_htod(ptr, memoryview(words), 16)
        assert read(sim, ptr, 16) == words.tobytes()
        into = array("i", [0] * 4)
        sim.memcpy_dtoh(memoryview(into), ptr, 16)
        assert into == words
        for bad in (
            lambda: sim.memcpy_htod(ptr, memoryview(bytes(32))[::2], 16),
            lambda: sim.memcpy_htod(ptr, memoryview(bytes(8)), 16),
            lambda: sim.memcpy_dtoh(memoryview(bytes(16)), ptr, 16),
            lambda: sim.memcpy_htod(ptr, memoryview(bytes(16)), -1),
            lambda: sim.memset_d8(ptr, 256, 1),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                bad()
        with pytest.raises(TypeError):
            sim.memcpy_htod(ptr, 12345, 4)  # type: ignore[arg-type]
        sim.mem_free(ptr)


def test_ipc_handle_names_a_memfd_of_this_process_with_the_bytes(sim: SimDriver) -> None:
    with created(sim, 1):
        ptr = sim.mem_alloc(1000)
        sim.memcpy_htod(ptr, memoryview(b"before"), 6)
        path = decode_handle(sim.ipc_get_mem_handle(ptr + 10))
        assert path.parent == Path(f"/proc/{os.getpid()}/fd") and path.stat().st_size == 1000
        assert os.readlink(path).startswith("/memfd:"), "a memfd: no file anywhere outlives the process"
        with path.open("r+b") as file, mmap.mmap(file.fileno(), 1000) as other_process:
            assert resize_sealed(file.fileno()), "another process cannot cut off pages the daemon touches"
            with pytest.raises(PermissionError):
                os.ftruncate(file.fileno(), 0)
            assert other_process[:6] == b"before", "exporting keeps the bytes"
            other_process[:5] = b"after"
            assert read(sim, ptr, 5) == b"after", "both sides see one memory"
            sim.memset_d8(ptr + 500, 7, 3)
            assert other_process[500:503] == b"\7\7\7"
        assert decode_handle(sim.ipc_get_mem_handle(ptr)) == path
        sim.mem_free(ptr)
        assert not path.exists(), "freeing closes the memfd"
        kept = sim.mem_alloc(64)
        kept_path = decode_handle(sim.ipc_get_mem_handle(kept))
    assert not kept_path.exists(), "destroying the context closes its memfds"


# --- contexts: what the driver leaves undefined, the sim refuses ----------------------------


def test_destroyed_context_is_refused(sim: SimDriver) -> None:
    ctx = sim.ctx_create(0, 0)
    sim.ctx_destroy(ctx)
    for call in (
        lambda: sim.ctx_destroy(ctx),
        lambda: sim.ctx_push(ctx),
        lambda: sim.ctx_set_current(ctx),
        lambda: sim.ctx_get_api_version(ctx),
        lambda: sim.ctx_push(Ctx(object())),
    ):
        with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
            call()
    with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
        sim.ctx_get_id(ctx)


def test_destroy_pops_only_from_the_top(sim: SimDriver) -> None:
    lower = sim.ctx_create(0, 0)
    upper = sim.ctx_create(0, 1)
    sim.ctx_destroy(lower)
    assert sim.ctx_get_current() == upper
    sim.ctx_destroy(upper)
    assert sim.ctx_get_current() == lower, "a destroyed context below the top stays"
    assert sim.ctx_get_device() == 0
    with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
        sim.mem_get_info()
    assert sim.ctx_pop() == lower


def test_context_flags(sim: SimDriver) -> None:
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        sim.ctx_create(0x03, 0)
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        sim.ctx_create(0x100, 0)
    ctx = sim.ctx_create(0x04, 0)
    assert sim.ctx_get_flags() == 0x04
    sim.ctx_destroy(ctx)
    primary = sim.primary_ctx_retain(0)
    sim.ctx_push(primary)
    assert sim.ctx_get_flags() == CU_CTX_MAP_HOST, "as the real driver reports"
    assert sim.primary_ctx_state(0) == (0, True)
    sim.ctx_pop()
    sim.primary_ctx_release(0)


def test_context_ids_count_from_one_and_none_means_current(sim: SimDriver) -> None:
    primary = sim.primary_ctx_retain(1)
    with created(sim) as ctx:
        assert [sim.ctx_get_id(primary), sim.ctx_get_id(ctx)] == [1, 2]
        assert sim.ctx_get_id(None) == 2  # type: ignore[arg-type]
    sim.primary_ctx_release(1)


# --- streams and events: what the contract cannot pin on a GPU -------------------------------

BIG = 512 * MIB


@pytest.fixture
def big() -> Iterator[SimDriver]:
    """A one-device sim with room for big copies, with a created context current on this thread."""
    driver = SimDriver(device_count=1, memory_per_device=BIG)
    driver.init()
    ctx = driver.ctx_create(0, 0)
    yield driver
    driver.ctx_destroy(ctx)
    assert driver.ctx_get_current() is None


class Hold:
    """Host work that keeps a stream busy until :meth:`release` (or the end of the ``with``)."""

    def __init__(self, sim: SimDriver, stream: Stream | None) -> None:
        self._gate = threading.Event()
        self.reached = threading.Event()
        sim.launch_host_func(stream, self._run)

    def _run(self) -> None:
        self.reached.set()
        assert self._gate.wait(10), "a test never released its hold"

    def release(self) -> None:
        self._gate.set()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def stream_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("sim-") and thread.is_alive()]


def wait_for_no_stream_threads(before: list[threading.Thread]) -> None:
    deadline = time.monotonic() + 10
    while set(stream_threads()) - set(before):
        assert time.monotonic() < deadline, f"stream threads still running: {stream_threads()}"
        time.sleep(0.005)


def test_pending_work_is_not_ready_until_it_runs(big: SimDriver) -> None:
    stream = big.stream_create()
    start, end = big.event_create(), big.event_create()
    big.event_record(start, stream)
    with Hold(big, stream) as hold:
        big.event_record(end, stream)
        assert hold.reached.wait(10)
        assert big.event_query(start) is True
        assert big.stream_query(stream) is False
        assert big.event_query(end) is False
        with raises_cuda("CUDA_ERROR_NOT_READY"):
            big.event_elapsed_time(start, end)
    big.stream_synchronize(stream)
    assert big.stream_query(stream) is True and big.event_query(end) is True
    assert big.event_elapsed_time(start, end) > 0
    assert big.event_elapsed_time(end, start) < 0, "the order of the arguments is the sign"
    for handle in (start, end):
        big.event_destroy(handle)
    big.stream_destroy(stream)


def test_rerecording_an_event_moves_it_and_waits_take_the_record_of_their_time(big: SimDriver) -> None:
    first, second = big.stream_create(non_blocking=True), big.stream_create(non_blocking=True)
    event = big.event_create(timing=False)
    ptr = big.mem_alloc(16)
    big.memset_d8(ptr, 0, 16)
    with Hold(big, first):
        big.event_record(event, first)
        big.stream_wait_event(second, event)
        big.memset_d8_async(ptr, 1, 16, second)
        big.event_record(event, second)  # a new record on the waiting stream
        assert big.event_query(event) is False
        assert read(big, ptr, 16) == bytes(16), "second waits for the first record"
    big.stream_synchronize(second)
    assert big.event_query(event) is True and read(big, ptr, 16) == b"\1" * 16
    big.mem_free(ptr)
    big.event_destroy(event)
    for stream in (first, second):
        big.stream_destroy(stream)


def test_non_blocking_streams_are_exempt_from_the_legacy_stream(big: SimDriver) -> None:
    blocking, exempt = big.stream_create(), big.stream_create(non_blocking=True)
    ptr = big.mem_alloc(16)
    with Hold(big, exempt):
        big.memset_d8(ptr, 3, 16)  # would hang if the legacy stream waited for `exempt`
        big.memset_d8_async(ptr, 4, 16, None)
        big.memset_d8_async(ptr, 5, 16, blocking)
        big.stream_synchronize(blocking)
        assert read(big, ptr, 16) == b"\5" * 16
        assert big.stream_query(exempt) is False
    with Hold(big, blocking):
        big.memset_d8_async(ptr, 6, 16, exempt)
        big.stream_synchronize(exempt)  # not held up by the blocking stream
        assert big.stream_query(blocking) is False
    big.ctx_synchronize()
    assert read(big, ptr, 16) == b"\6" * 16
    big.mem_free(ptr)
    for stream in (blocking, exempt):
        big.stream_destroy(stream)


def test_legacy_async_work_and_blocking_streams_order_both_ways(big: SimDriver) -> None:
    stream = big.stream_create()
    ptr = big.mem_alloc(16)
    big.memset_d8(ptr, 0, 16)
    with Hold(big, None):
        big.memset_d8_async(ptr, 7, 16, stream)
        assert big.stream_query(stream) is False, "a blocking stream waits for the held legacy stream"
    big.stream_synchronize(stream)
    with Hold(big, stream):
        event = big.event_create(timing=False)
        big.event_record(event, None)
        assert big.event_query(event) is False, "the legacy stream waits for the held blocking stream"
    big.event_synchronize(event)
    assert read(big, ptr, 16) == b"\7" * 16
    big.event_destroy(event)
    big.stream_destroy(stream)
    big.mem_free(ptr)


def test_executor_threads_start_with_work_and_end_after_destroy(big: SimDriver) -> None:
    before = stream_threads()
    stream = big.stream_create()
    assert stream_threads() == before, "lazily started"
    ptr = big.mem_alloc(16)
    with Hold(big, stream) as hold:
        big.memset_d8_async(ptr, 9, 16, stream)
        assert len(set(stream_threads()) - set(before)) == 1, "started by its first work"
        big.stream_destroy(stream)  # returns at once, though work is queued
        assert hold.reached.wait(10)
    big.ctx_synchronize()
    assert read(big, ptr, 16) == b"\x09" * 16, "queued work still completed"
    wait_for_no_stream_threads(before)
    big.mem_free(ptr)


def test_destroyed_streams_and_events_are_refused(big: SimDriver) -> None:
    """Undefined on the real driver (it segfaults on most of these); the sim refuses them."""
    stream, event = big.stream_create(), big.event_create()
    live_stream, live_event = big.stream_create(), big.event_create()
    ptr = big.mem_alloc(64)
    host = bytearray(64)
    big.stream_destroy(stream)
    big.event_destroy(event)
    for call in (
        lambda: big.stream_destroy(stream),
        lambda: big.stream_query(stream),
        lambda: big.stream_synchronize(stream),
        lambda: big.stream_wait_event(stream, live_event),
        lambda: big.stream_wait_event(live_stream, event),
        lambda: big.event_record(live_event, stream),
        lambda: big.event_record(event, live_stream),
        lambda: big.event_elapsed_time(event, live_event),
        lambda: big.event_destroy(event),
        lambda: big.memset_d8_async(ptr, 0, 64, stream),
        lambda: big.memcpy_htod_async(ptr, memoryview(host), 64, stream),
        lambda: big.memcpy_dtoh_async(memoryview(host), ptr, 64, stream),
        lambda: big.memcpy_dtod_async(ptr, ptr, 64, stream),
        lambda: big.stream_query(Stream(object())),
        lambda: big.event_query(Event(None)),
    ):
        with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
            call()
    for call in (lambda: big.event_query(event), lambda: big.event_synchronize(event)):
        with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
            call()  # what the real driver answers; the calls above crash it
    big.mem_free(ptr)
    big.stream_destroy(live_stream)
    big.event_destroy(live_event)


def test_context_destruction_takes_its_streams_and_events(big: SimDriver) -> None:
    before = stream_threads()
    ctx = big.ctx_create(0, 0)
    stream, event = big.stream_create(non_blocking=True), big.event_create()
    host = bytearray(16)
    ptr = big.mem_alloc(16)
    big.memset_d8(ptr, 0x33, 16)
    hold = Hold(big, stream)
    big.memcpy_dtoh_async(memoryview(host), ptr, 16, stream)
    big.event_record(event, stream)
    releaser = threading.Timer(0.05, hold.release)
    releaser.start()
    big.ctx_destroy(ctx)  # waits for the queued work, then frees
    releaser.join()
    assert host == b"\x33" * 16
    with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
        big.stream_query(stream)
    with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
        big.event_query(event)
    wait_for_no_stream_threads(before)


def test_events_and_streams_across_contexts(big: SimDriver) -> None:
    outer = big.ctx_get_current()
    stream, event = big.stream_create(), big.event_create()
    ptr = big.mem_alloc(16)
    with created(big):
        big.memset_d8_async(ptr, 0x21, 16, stream)  # a stream of another context still works
        big.event_record(event, stream)
        big.event_synchronize(event)
        assert big.event_query(event) is True
        own = big.stream_create()
        with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
            big.event_record(event, own)
        with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
            big.event_record(event, None)  # the legacy stream of the current, other context
        big.stream_wait_event(own, event)
        big.stream_synchronize(own)
        big.stream_destroy(own)
    assert big.ctx_get_current() == outer
    assert read(big, ptr, 16) == b"\x21" * 16
    big.mem_free(ptr)
    big.event_destroy(event)
    big.stream_destroy(stream)


def test_errors_of_queued_work_surface_once_at_the_next_sync(big: SimDriver) -> None:
    stream = big.stream_create(non_blocking=True)
    ptr = big.mem_alloc(64)
    host = bytearray(64)
    with Hold(big, stream):
        big.memcpy_dtoh_async(memoryview(host), ptr, 64, stream)
        big.mem_free(ptr)  # does not wait for a non-blocking stream
    with raises_cuda("CUDA_ERROR_ILLEGAL_ADDRESS"):
        big.stream_synchronize(stream)
    big.stream_synchronize(stream)  # reported once
    assert big.stream_query(stream) is True

    def fail() -> None:
        raise CudaError.of(CUresult.CUDA_ERROR_LAUNCH_FAILED)

    big.launch_host_func(stream, fail)
    big.launch_host_func(stream, lambda: None)
    with raises_cuda("CUDA_ERROR_LAUNCH_FAILED"):
        big.ctx_synchronize()
    assert big.stream_query(stream) is True
    big.stream_destroy(stream)


def test_queued_work_finds_the_bytes_where_they_are_when_it_runs(big: SimDriver) -> None:
    stream = big.stream_create(non_blocking=True)
    ptr = big.mem_alloc(4096)
    big.memset_d8(ptr, 1, 4096)
    with Hold(big, stream):
        big.memset_d8_async(ptr + 100, 2, 10, stream)
        path = decode_handle(big.ipc_get_mem_handle(ptr))  # moves the bytes to a shared file meanwhile
    big.stream_synchronize(stream)
    shared = path.read_bytes()
    assert shared[99:111] == b"\1" + b"\2" * 10 + b"\1", "the fill went to the shared file"
    assert read(big, ptr + 99, 12) == shared[99:111]
    big.mem_free(ptr)
    big.stream_destroy(stream)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_big_copies_leave_the_gil_to_other_threads(big: SimDriver, mode: str) -> None:
    size = 128 * MIB
    src, dst = big.mem_alloc(size), big.mem_alloc(size)
    big.memset_d8(src, 0x6B, size)
    stream = big.stream_create()
    ctx = big.ctx_get_current()
    finished = threading.Event()

    def copy() -> None:
        big.ctx_push(ctx)  # type: ignore[arg-type]
        try:
            if mode == "sync":
                big.memcpy_dtod(dst, src, size)
            else:
                big.memcpy_dtod_async(dst, src, size, stream)
                big.stream_synchronize(stream)
        finally:
            big.ctx_pop()
            finished.set()

    copier = threading.Thread(target=copy)
    started = last = time.perf_counter()
    longest = 0.0
    copier.start()
    while not finished.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    copier.join()
    took = last - started
    assert longest < max(took / 2, 0.002), f"this thread stalled {longest * 1e3:.1f} ms of a {took * 1e3:.1f} ms copy"
    assert read(big, dst + size - 4, 4) == b"\x6b" * 4
    big.stream_destroy(stream)
    big.mem_free(src)
    big.mem_free(dst)


# --- stream-ordered pools ---------------------------------------------------------------------


def test_pool_hands_the_same_block_back_and_accounts_cached_memory(sim: SimDriver) -> None:
    with created(sim):
        pool = sim.mem_pool_create(0)
        ptr = sim.mem_alloc_from_pool(1000, pool, None)
        assert sim.mem_get_info()[0] == CAPACITY - 1024
        sim.memcpy_htod(ptr, memoryview(b"kept"), 4)
        sim.mem_free_async(ptr, None)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            read(sim, ptr, 4)  # freed from the call on, though cached
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            sim.mem_free_async(ptr, None)
        assert sim.mem_get_info()[0] == CAPACITY - 1024, "cached memory counts as used"
        again = sim.mem_alloc_from_pool(1001, pool, None)
        assert again == ptr and read(sim, again, 4) == b"kept", "the same block, not cleared"
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            read(sim, again + 1001, 1)
        other = sim.mem_alloc_from_pool(4096, pool, None)
        assert other != ptr
        sim.mem_free(again)
        sim.mem_free(other)
        assert sim.mem_get_info()[0] == CAPACITY - 1024 - 4096
        sim.mem_pool_trim(pool, 4096)
        assert sim.mem_get_info()[0] == CAPACITY - 1024, "trimmed to what it may keep, biggest blocks first"
        sim.mem_pool_trim(pool, 0)
        assert sim.mem_get_info()[0] == CAPACITY
        sim.mem_pool_destroy(pool)


def test_pool_memory_is_freed_in_stream_order(sim: SimDriver) -> None:
    with created(sim):
        pool, stream = sim.mem_pool_create(0), sim.stream_create()
        ptr = sim.mem_alloc_from_pool(4096, pool, stream)
        with Hold(sim, stream):
            sim.mem_free_async(ptr, stream)
            assert sim.mem_alloc_from_pool(4096, pool, stream) != ptr, "not back in the pool yet"
        sim.stream_synchronize(stream)
        assert sim.mem_alloc_from_pool(4096, pool, stream) == ptr
        regular = sim.mem_alloc(4096)
        sim.mem_free_async(regular, stream)  # cuMemAlloc memory is freed to the device in stream order
        sim.stream_synchronize(stream)
        sim.mem_pool_destroy(pool)
        assert sim.mem_get_info()[0] == CAPACITY - 2 * 4096, "blocks in use outlive their pool"
        sim.ctx_synchronize()
        sim.stream_destroy(stream)


def test_destroyed_pool_gives_blocks_back_when_freed(sim: SimDriver) -> None:
    with created(sim):
        pool = sim.mem_pool_create(1)
        cached = sim.mem_alloc_from_pool(512, pool, None)
        used = sim.mem_alloc_from_pool(512, pool, None)
        assert sim.mem_get_info()[0] == CAPACITY, "a pool of device 1 uses device 1's memory"
        sim.mem_free(cached)
        sim.mem_pool_destroy(pool)
        for call in (
            lambda: sim.mem_alloc_from_pool(512, pool, None),
            lambda: sim.mem_pool_trim(pool, 0),
            lambda: sim.mem_pool_destroy(pool),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                call()
        with created(sim, 1):
            assert sim.mem_get_info()[0] == CAPACITY - 512
            sim.mem_free(used)
            assert sim.mem_get_info()[0] == CAPACITY


def test_full_device_makes_a_pool_give_back_its_cache(sim: SimDriver) -> None:
    with created(sim):
        pool = sim.mem_pool_create(0)
        half = sim.mem_alloc_from_pool(CAPACITY // 2, pool, None)
        sim.mem_free(half)
        whole = sim.mem_alloc_from_pool(CAPACITY, pool, None)
        assert sim.mem_get_info()[0] == 0
        with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
            sim.mem_alloc_from_pool(1, pool, None)
        sim.mem_free(whole)
        with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
            sim.mem_alloc(1)  # the cache of a pool is not given up for cuMemAlloc
        sim.mem_pool_destroy(pool)
        assert sim.mem_get_info()[0] == CAPACITY


def test_pool_arguments_are_checked(sim: SimDriver) -> None:
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        sim.mem_pool_create(2)
    pool = sim.mem_pool_create(0)
    with created(sim):
        for call in (
            lambda: sim.mem_pool_trim(pool, -1),
            lambda: sim.mem_alloc_from_pool(-5, pool, None),
            lambda: sim.mem_pool_trim(Pool(object()), 0),
            lambda: sim.mem_free_async(0x1234, None),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                call()
        sim.mem_free_async(0, None)  # NULL, as for mem_free
        with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
            sim.mem_alloc_from_pool(16, pool, Stream(object()))
    with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
        sim.mem_alloc_from_pool(16, pool, None)
    sim.mem_pool_destroy(pool)


def test_pool_alloc_and_free_reuse_one_cached_block(sim: SimDriver) -> None:
    """The fast path: a pool alloc+free loop keeps handing out the same cached block (its
    speed is measured in bench/, not here)."""
    with created(sim):
        pool, stream = sim.mem_pool_create(0), sim.stream_create()
        for target in (None, stream):
            first = sim.mem_alloc_from_pool(MIB, pool, target)
            sim.mem_free_async(first, target)
            sim.stream_synchronize(stream)
            for _ in range(100):
                again = sim.mem_alloc_from_pool(MIB, pool, target)
                assert again == first
                sim.mem_free_async(again, target)
                sim.stream_synchronize(stream)
        sim.stream_destroy(stream)
        sim.mem_pool_destroy(pool)


# --- pinned host memory -----------------------------------------------------------------------


def test_pinned_memory_is_page_aligned_zeroed_and_owned_by_its_context(sim: SimDriver) -> None:
    with created(sim):
        view = sim.mem_alloc_host(10_000)
        assert view.nbytes == 10_000 and bytes(view) == bytes(10_000)
        with buffer_address(view) as address:
            assert address % mmap.PAGESIZE == 0
        for bad in (memoryview(view)[1:], bytearray(16), b"immutable", 12345):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                sim.mem_free_host(bad)  # type: ignore[arg-type]
        sim.mem_free_host(view)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            sim.mem_free_host(view)
        empty = sim.mem_alloc_host(0)
        assert empty.nbytes == 0 and not empty.readonly
        sim.mem_free_host(empty)  # NULL, as cuMemAllocHost(0) gives
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            sim.mem_alloc_host(-1)
        orphan = sim.mem_alloc_host(4096)
        orphan[:4] = b"kept"
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        sim.mem_free_host(orphan)  # freed with its context
    with created(sim):
        sim.ctx_synchronize()


def test_copies_and_fills_cross_the_gil_free_threshold_exactly() -> None:
    for size in (GIL_FREE_SIZE - 1, GIL_FREE_SIZE, GIL_FREE_SIZE + 1):
        source = bytes(range(256)) * (size // 256 + 1)
        target = bytearray(size + 2)
        copy_bytes(memoryview(target)[1 : size + 1], memoryview(source)[:size])
        assert target[0] == 0 and target[-1] == 0 and target[1 : size + 1] == source[:size]
        fill_bytes(memoryview(target)[1 : size + 1], 0xEE)
        assert target[0] == 0 and target[-1] == 0 and target[1 : size + 1] == b"\xee" * size
