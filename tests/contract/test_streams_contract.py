"""The driver contract for streams, events, stream-ordered pools and pinned memory.

Each test runs against ``sim`` and, where a GPU is present, ``cuda`` (see
``conftest.py``). What is asserted is what CUDA guarantees: the order of work on
one stream and across streams joined by an event or by the legacy default
stream, the states after a synchronisation, and error names. Whether a query
sees work still pending depends on timing, so :meth:`Bench.keep_busy` queues
device-to-device copies until it does, doubling them each time they finished
too soon (256 MiB each on a GPU); ordering tests start with such a backlog so
that a missing dependency would show. Where only the outcome of a race is known
(``event_elapsed_time`` during work) either outcome is accepted.

Using a stream or event after it was destroyed is undefined on the real driver
(handles are reused, and it can crash the process): that the sim refuses it is
pinned in ``tests/unit/daemon/backends/test_sim_driver.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from cuctxd.daemon.backends.base import Driver, Event, Pool, Stream
from cuctxd.protos.errors import CudaError
from tests.helpers import in_thread, primary_current, raises_cuda

MIB = 1 << 20
#: The most bytes one busy-making copy moves; less on small (simulated) devices.
BUSY_COPY = 256 * MIB


class Bench:
    """The primary context of device 0, current, and everything a test makes in it.

    Every stream, event, pool, allocation and pinned buffer made through it is
    released when the test ends, after ``ctx_synchronize``, newest first.
    """

    def __init__(self, driver: Driver, cleanup: ExitStack) -> None:
        self.driver = driver
        self._cleanup = cleanup
        self._scratch: tuple[int, int, int] | None = None

    def alloc(self, size: int) -> int:
        ptr = self.driver.mem_alloc(size)
        self._cleanup.callback(self.driver.mem_free, ptr)
        return ptr

    def stream(self, non_blocking: bool = False) -> Stream:
        stream = self.driver.stream_create(non_blocking)
        self._cleanup.callback(self.driver.stream_destroy, stream)
        return stream

    def event(self, timing: bool = True) -> Event:
        event = self.driver.event_create(timing)
        self._cleanup.callback(self.driver.event_destroy, event)
        return event

    def pool(self) -> Pool:
        pool = self.driver.mem_pool_create(0)
        self._cleanup.callback(self.driver.mem_pool_destroy, pool)
        return pool

    def pinned(self, size: int) -> memoryview:
        view = self.driver.mem_alloc_host(size)
        self._cleanup.callback(self.driver.mem_free_host, view)
        return view

    def read(self, ptr: int, size: int) -> bytes:
        out = bytearray(size)
        self.driver.memcpy_dtoh(memoryview(out), ptr, size)
        return bytes(out)

    def keep_busy(self, stream: Stream | None) -> None:
        """Queue copies on ``stream`` (None: the legacy stream) until it is seen with work pending.

        As many copies again are queued behind that, so the backlog outlasts the
        next few calls of the test.
        """
        first, second, size = self._scratch_buffers()
        probe = self.event(timing=False)
        copies = 2
        for _ in range(10):
            for index in range(copies):
                dst, src = (second, first) if index % 2 == 0 else (first, second)
                self.driver.memcpy_dtod_async(dst, src, size, stream)
            self.driver.event_record(probe, stream)
            if not self.driver.event_query(probe):
                if stream is not None:
                    assert self.driver.stream_query(stream) is False, "an event is pending, so is its stream"
                for index in range(copies):
                    dst, src = (second, first) if index % 2 == 0 else (first, second)
                    self.driver.memcpy_dtod_async(dst, src, size, stream)
                return
            self.driver.event_synchronize(probe)
            copies *= 2
        pytest.fail(f"{copies} copies of {size} bytes never kept the stream busy")

    def _scratch_buffers(self) -> tuple[int, int, int]:
        if self._scratch is None:
            size = min(BUSY_COPY, self.driver.device_info(0).total_memory // 8)
            self._scratch = (self.alloc(size), self.alloc(size), size)
        return self._scratch


@pytest.fixture
def bench(driver: Driver) -> Iterator[Bench]:
    with primary_current(driver), ExitStack() as cleanup:
        yield Bench(driver, cleanup)
        driver.ctx_synchronize()


# --- order of work ---------------------------------------------------------------------------


def test_work_on_one_stream_runs_in_order(bench: Bench) -> None:
    driver = bench.driver
    stream = bench.stream()
    first, second = bench.alloc(MIB), bench.alloc(MIB)
    payload = bytes(range(256)) * 4096
    out = bytearray(MIB)
    bench.keep_busy(stream)
    driver.memcpy_htod_async(first, memoryview(payload), MIB, stream)
    driver.memcpy_dtod_async(second, first, MIB, stream)
    driver.memset_d8_async(second + 1000, 0xEE, 24, stream)
    driver.memcpy_dtoh_async(memoryview(out), second, MIB, stream)
    driver.stream_synchronize(stream)
    assert out[:1000] == payload[:1000]
    assert out[1000:1024] == b"\xee" * 24
    assert out[1024:] == payload[1024:]
    assert driver.stream_query(stream) is True


def test_queries_are_true_after_synchronize(bench: Bench) -> None:
    driver = bench.driver
    stream, event = bench.stream(), bench.event()
    assert driver.stream_query(stream) is True, "a new stream has no work"
    bench.keep_busy(stream)
    driver.event_record(event, stream)
    driver.stream_synchronize(stream)
    assert driver.stream_query(stream) is True
    assert driver.event_query(event) is True
    driver.event_synchronize(event)


def test_elapsed_time_between_two_records(bench: Bench) -> None:
    driver = bench.driver
    stream, start, end = bench.stream(), bench.event(), bench.event()
    driver.event_record(start, stream)
    bench.keep_busy(stream)
    driver.event_record(end, stream)
    try:
        early = driver.event_elapsed_time(start, end)
    except CudaError as pending:
        assert pending.name == "CUDA_ERROR_NOT_READY", pending
    else:
        assert early > 0 and driver.event_query(end), "only a completed pair has a time"
    driver.event_synchronize(end)
    assert driver.event_query(start) is True
    assert driver.event_elapsed_time(start, end) > 0


def test_elapsed_time_needs_timed_recorded_events(bench: Bench) -> None:
    driver = bench.driver
    timed, never_recorded, untimed = bench.event(), bench.event(), bench.event(timing=False)
    assert driver.event_query(never_recorded) is True, "an event never recorded counts as complete"
    driver.event_synchronize(never_recorded)
    driver.event_record(timed, None)
    driver.event_record(untimed, None)
    driver.event_synchronize(timed)
    driver.event_synchronize(untimed)
    for start, end in ((timed, never_recorded), (never_recorded, timed), (timed, untimed), (untimed, timed)):
        with raises_cuda("CUDA_ERROR_INVALID_HANDLE"):
            driver.event_elapsed_time(start, end)


def test_stream_wait_event_orders_two_streams(bench: Bench) -> None:
    driver = bench.driver
    producer, consumer = bench.stream(), bench.stream()
    done, never_recorded = bench.event(timing=False), bench.event(timing=False)
    source, copy = bench.alloc(4096), bench.alloc(4096)
    driver.memset_d8(source, 0, 4096)
    out = bytearray(4096)
    driver.stream_wait_event(consumer, never_recorded)  # waits for nothing
    driver.memset_d8_async(copy, 0, 4096, consumer)
    driver.stream_synchronize(consumer)  # the consumer is ready to go at once
    bench.keep_busy(producer)
    driver.memset_d8_async(source, 0xAB, 4096, producer)
    driver.event_record(done, producer)
    driver.stream_wait_event(consumer, done)
    driver.memcpy_dtod_async(copy, source, 4096, consumer)
    driver.memcpy_dtoh_async(memoryview(out), copy, 4096, consumer)
    driver.stream_synchronize(consumer)
    assert out == b"\xab" * 4096, "the consumer ran before the producer's record"


def test_synchronous_copies_wait_for_blocking_streams(bench: Bench) -> None:
    driver = bench.driver
    stream = bench.stream()
    target = bench.alloc(4096)
    driver.memset_d8(target, 0, 4096)
    bench.keep_busy(stream)
    driver.memset_d8_async(target, 0xCD, 4096, stream)
    assert bench.read(target, 4096) == b"\xcd" * 4096, "the legacy stream waits for blocking streams"


def test_blocking_streams_wait_for_the_legacy_stream(bench: Bench) -> None:
    driver = bench.driver
    stream = bench.stream()
    source, copy = bench.alloc(4096), bench.alloc(4096)
    driver.memset_d8(source, 0, 4096)
    out = bytearray(4096)
    bench.keep_busy(None)
    driver.memset_d8_async(source, 0x5A, 4096, None)
    driver.memcpy_dtod_async(copy, source, 4096, stream)
    driver.memcpy_dtoh_async(memoryview(out), copy, 4096, stream)
    driver.stream_synchronize(stream)
    assert out == b"\x5a" * 4096, "work on a blocking stream waits for earlier legacy-stream work"


def test_destroyed_stream_finishes_its_work(bench: Bench) -> None:
    driver = bench.driver
    target = bench.alloc(4096)
    driver.memset_d8(target, 0, 4096)
    stream = driver.stream_create(non_blocking=True)
    bench.keep_busy(stream)
    driver.memset_d8_async(target, 0x42, 4096, stream)
    driver.stream_destroy(stream)  # returns at once
    driver.ctx_synchronize()
    assert bench.read(target, 4096) == b"\x42" * 4096


def test_ctx_synchronize_waits_for_every_stream(bench: Bench) -> None:
    """Blocking, non-blocking and the legacy stream: a synchronous read waits for none of the
    non-blocking one's work, so only a ``ctx_synchronize`` that waited shows its bytes."""
    driver = bench.driver
    blocking, exempt = bench.stream(), bench.stream(non_blocking=True)
    target = bench.alloc(3 * 4096)
    driver.memset_d8(target, 0, 3 * 4096)
    legacy_done = bench.event(timing=False)
    for index, stream in enumerate((blocking, exempt, None)):
        bench.keep_busy(stream)
        driver.memset_d8_async(target + index * 4096, 0x61 + index, 4096, stream)
    driver.event_record(legacy_done, None)
    driver.ctx_synchronize()
    assert driver.stream_query(blocking) is True
    assert driver.stream_query(exempt) is True
    assert driver.event_query(legacy_done) is True
    assert bench.read(target, 3 * 4096) == b"".join(bytes([0x61 + i]) * 4096 for i in range(3))


def test_async_calls_check_their_arguments(bench: Bench) -> None:
    driver = bench.driver
    stream = bench.stream()
    ptr = bench.alloc(1000)
    host = bytearray(64)
    for call in (
        lambda: driver.memcpy_htod_async(ptr + 990, memoryview(host), 20, stream),
        lambda: driver.memcpy_dtoh_async(memoryview(host), ptr + 990, 20, stream),
        lambda: driver.memcpy_dtoh_async(memoryview(bytes(64)), ptr, 64, stream),
        lambda: driver.memset_d8_async(ptr + 950, 1, 100, stream),
        lambda: driver.memcpy_dtod_async(ptr, ptr + 990, 20, None),
        lambda: driver.memcpy_htod_async(0x10, memoryview(host), 16, None),
    ):
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            call()
    driver.stream_synchronize(stream)


def test_streams_events_and_pinned_memory_need_a_context(driver: Driver) -> None:
    def body() -> None:
        for call in (
            driver.stream_create,
            driver.event_create,
            lambda: driver.mem_alloc_host(4096),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
                call()

    in_thread(body)


# --- stream-ordered pools --------------------------------------------------------------------


def test_pool_memory_is_cached_reused_and_trimmed(bench: Bench) -> None:
    driver = bench.driver
    stream, pool = bench.stream(), bench.pool()
    size = 32 * MIB
    free_before = driver.mem_get_info()[0]
    ptr = driver.mem_alloc_from_pool(size, pool, stream)
    driver.memset_d8_async(ptr, 0x77, size, stream)
    out = bytearray(16)
    driver.memcpy_dtoh_async(memoryview(out), ptr + size - 16, 16, stream)
    driver.mem_free_async(ptr, stream)
    driver.stream_synchronize(stream)
    assert out == b"\x77" * 16
    free_cached = driver.mem_get_info()[0]
    assert free_cached <= free_before - size, "memory cached in a pool counts as used"

    again = driver.mem_alloc_from_pool(size, pool, stream)
    assert driver.mem_get_info()[0] >= free_cached - 8 * MIB, "the cached memory is handed out again"
    driver.mem_free_async(again, stream)
    driver.stream_synchronize(stream)
    driver.mem_pool_trim(pool, 0)
    assert driver.mem_get_info()[0] >= free_cached + size - 8 * MIB, "trimming gives it back"


def test_pool_memory_can_be_freed_synchronously(bench: Bench) -> None:
    driver = bench.driver
    pool = bench.pool()
    ptr = driver.mem_alloc_from_pool(4096, pool, None)
    driver.memcpy_htod(ptr, memoryview(b"pooled"), 6)
    assert bench.read(ptr, 6) == b"pooled"
    driver.mem_free(ptr)  # cuMemFree accepts stream-ordered allocations
    other = driver.mem_alloc_from_pool(4096, pool, None)
    driver.mem_free_async(other, None)


def test_pool_errors(bench: Bench) -> None:
    driver = bench.driver
    pool = bench.pool()
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        # The interface's choice, like mem_alloc: cuMemAllocFromPoolAsync(0) itself
        # succeeds with NULL (H200, driver 580), so the cuda backend must check.
        driver.mem_alloc_from_pool(0, pool, None)
    with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
        driver.mem_alloc_from_pool(driver.device_info(0).total_memory + MIB, pool, None)
    ptr = driver.mem_alloc_from_pool(MIB, pool, None)
    try:
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.ipc_get_mem_handle(ptr)  # pool memory has no legacy IPC handle
    finally:
        driver.mem_free_async(ptr, None)


# --- pinned host memory ----------------------------------------------------------------------


def test_pinned_memory_round_trip_with_async_copies(bench: Bench) -> None:
    driver = bench.driver
    stream = bench.stream()
    size = MIB
    outbound, inbound = bench.pinned(size), bench.pinned(size)
    assert not outbound.readonly and outbound.nbytes == size
    outbound[:] = bytes(range(256)) * (size // 256)
    device = bench.alloc(size)
    driver.memcpy_htod_async(device, outbound, size, stream)
    driver.memset_d8_async(device, 0x01, 8, stream)
    driver.memcpy_dtoh_async(inbound, device, size, stream)
    driver.stream_synchronize(stream)
    assert inbound[:8] == b"\x01" * 8
    assert inbound[8:] == outbound[8:]


def test_freeing_other_host_memory_is_invalid_value(bench: Bench) -> None:
    driver = bench.driver
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        driver.mem_free_host(memoryview(bytearray(4096)))
    view = driver.mem_alloc_host(8192)
    with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        driver.mem_free_host(view[4096:])
    driver.mem_free_host(view)


def test_pinned_allocation_of_nothing_is_empty(bench: Bench) -> None:
    empty = bench.driver.mem_alloc_host(0)  # cuMemAllocHost(0) gives NULL
    assert empty.nbytes == 0
    bench.driver.mem_free_host(empty)
