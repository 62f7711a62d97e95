"""The driver contract: the same sequences, the same results, on every backend.

Each test runs against ``sim`` and, where a GPU is present, ``cuda`` (see
``conftest.py``), and asserts CUDA's own error names. What is pinned here was
observed on an H200 with driver 580; the sim must match it. Tests that need a
fresh context stack run their body in a new thread, and every test releases
what it made (on a GPU a created context costs ~110 ms, so few are made).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

from cuctxd.daemon.backends.base import IPC_HANDLE_SIZE, Driver
from cuctxd.protos.cuda_results import DRIVER_MESSAGES
from tests.helpers import HostThread, allocation, in_thread, primary_current, raises_cuda

MIB = 1 << 20
PATTERN = bytes(range(256))


def require_inactive_primary(driver: Driver, ordinal: int = 0) -> None:
    if driver.primary_ctx_state(ordinal)[1]:
        pytest.skip(f"the primary context of device {ordinal} is retained outside this test")


# --- devices -------------------------------------------------------------------------------


def test_device_info_is_sane(driver: Driver) -> None:
    count = driver.device_count()
    assert count >= 1
    infos = [driver.device_info(ordinal) for ordinal in range(count)]
    for ordinal, info in enumerate(infos):
        assert info.index == ordinal
        assert isinstance(info.name, str) and info.name and "\0" not in info.name
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", info.uuid)
        assert re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", info.pci_bus_id)
        major, minor = info.compute_capability
        assert isinstance(major, int) and isinstance(minor, int) and major >= 3
        assert info.total_memory > 0
        assert info.multiprocessor_count > 0
        assert driver.device_info(ordinal) == info, "device info must be stable"
    assert len({info.uuid for info in infos}) == count
    assert len({info.pci_bus_id for info in infos}) == count


def test_invalid_device_ordinal(driver: Driver) -> None:
    bad = driver.device_count()
    for call in (
        lambda: driver.device_info(bad),
        lambda: driver.primary_ctx_retain(bad),
        lambda: driver.primary_ctx_release(bad),
        lambda: driver.primary_ctx_state(bad),
        lambda: driver.ctx_create(0, bad),
    ):
        with raises_cuda("CUDA_ERROR_INVALID_DEVICE"):
            call()


# --- the calling thread's context stack ----------------------------------------------------


def test_fresh_thread_has_no_current_context(driver: Driver) -> None:
    def body() -> None:
        assert driver.ctx_get_current() is None
        for call in (
            driver.ctx_get_device,
            driver.ctx_get_flags,
            driver.ctx_synchronize,
            driver.ctx_pop,
            driver.mem_get_info,
            lambda: driver.mem_alloc(16),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
                call()
        driver.ctx_set_current(None)  # unbinding nothing is fine
        assert driver.ctx_get_current() is None

    in_thread(body)


def test_pop_on_empty_stack_is_invalid_context(driver: Driver) -> None:
    def body() -> None:  # a fresh thread's stack is empty (this one may hold a framework's context)
        with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
            driver.ctx_pop()

    in_thread(body)


def test_primary_context_refcount_and_state(driver: Driver) -> None:
    require_inactive_primary(driver)
    flags, active = driver.primary_ctx_state(0)
    assert (flags, active) == (0, False)
    with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
        driver.primary_ctx_release(0)
    first = driver.primary_ctx_retain(0)
    assert driver.primary_ctx_state(0) == (0, True)
    assert driver.ctx_get_current() is None, "retaining does not make it current"
    second = driver.primary_ctx_retain(0)
    assert second == first, "one primary context per device"
    driver.primary_ctx_release(0)
    assert driver.primary_ctx_state(0)[1] is True, "still retained once"
    driver.primary_ctx_release(0)
    assert driver.primary_ctx_state(0)[1] is False
    with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
        driver.primary_ctx_release(0)


def test_primary_context_comes_back_with_a_new_id(driver: Driver) -> None:
    require_inactive_primary(driver)
    ctx = driver.primary_ctx_retain(0)
    first_id = driver.ctx_get_id(ctx)
    driver.primary_ctx_release(0)
    again = driver.primary_ctx_retain(0)
    try:
        assert driver.ctx_get_id(again) > first_id
    finally:
        driver.primary_ctx_release(0)


def test_released_primary_still_current_is_destroyed(driver: Driver) -> None:
    require_inactive_primary(driver)

    def body() -> None:
        ctx = driver.primary_ctx_retain(0)
        driver.ctx_push(ctx)
        ptr = driver.mem_alloc(MIB)
        driver.primary_ctx_release(0)
        assert driver.primary_ctx_state(0)[1] is False
        assert driver.ctx_get_current() == ctx, "release does not pop"
        assert driver.ctx_get_device() == 0
        for call in (
            lambda: driver.mem_alloc(16),
            lambda: driver.mem_free(ptr),
            driver.ctx_synchronize,
            lambda: driver.ctx_get_id(ctx),
        ):
            with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
                call()
        assert driver.ctx_pop() == ctx

    in_thread(body)


def test_destroying_a_primary_context_is_invalid(driver: Driver) -> None:
    ctx = driver.primary_ctx_retain(0)
    try:
        with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
            driver.ctx_destroy(ctx)
        assert driver.primary_ctx_state(0)[1] is True
    finally:
        driver.primary_ctx_release(0)


def test_ctx_create_pushes_and_becomes_current(driver: Driver) -> None:
    def body() -> None:
        ctx = driver.ctx_create(0, 0)
        try:
            assert driver.ctx_get_current() == ctx
            assert driver.ctx_get_device() == 0
            assert driver.ctx_get_flags() == 0
            assert driver.ctx_get_api_version(ctx) == 3020
        finally:
            driver.ctx_destroy(ctx)
        assert driver.ctx_get_current() is None, "destroy pops the caller's current context"

    in_thread(body)


def test_push_pop_and_set_current_order(driver: Driver) -> None:
    def body() -> None:
        primary = driver.primary_ctx_retain(0)
        created = driver.ctx_create(0, 0)
        try:
            driver.ctx_push(primary)
            assert driver.ctx_get_current() == primary
            assert driver.ctx_pop() == primary
            assert driver.ctx_get_current() == created
            driver.ctx_push(primary)
            driver.ctx_set_current(None)  # pops the top
            assert driver.ctx_get_current() == created
            driver.ctx_set_current(primary)  # replaces the top
            assert driver.ctx_get_current() == primary
            assert driver.ctx_pop() == primary
            assert driver.ctx_get_current() is None
            with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
                driver.ctx_pop()
            driver.ctx_set_current(created)  # an empty stack gets it pushed
            assert driver.ctx_pop() == created
        finally:
            driver.ctx_destroy(created)
            driver.primary_ctx_release(0)

    in_thread(body)


def test_context_stacks_are_per_thread(driver: Driver) -> None:
    mine = driver.ctx_get_current()  # None, or a framework's context (torch's, say)
    first_has_context = threading.Event()
    second_done = threading.Event()

    def first() -> None:
        ctx = driver.ctx_create(0, 0)
        try:
            first_has_context.set()
            assert second_done.wait(30)
            assert driver.ctx_get_current() == ctx, "the other thread's push and pop left this one alone"
        finally:
            driver.ctx_destroy(ctx)

    def second() -> None:
        try:
            assert driver.ctx_get_current() is None, "a new thread sees none of another's stack"
            with primary_current(driver):
                assert driver.ctx_get_device() == 0
        finally:
            second_done.set()

    thread_one = HostThread(first)
    first_has_context.wait(30)
    thread_two = HostThread(second)
    thread_two.join()
    thread_one.join()
    assert driver.ctx_get_current() == mine, "the other threads' stacks left this one's alone"


def test_concurrent_threads_keep_their_own_stack_and_data(driver: Driver) -> None:
    """Four host threads at once, each with a created context (spread over the devices) and its
    own buffer, written and read back while the others do the same."""
    start = threading.Barrier(4)

    def worker(index: int) -> None:
        ctx = driver.ctx_create(0, index % driver.device_count())
        try:
            start.wait(30)
            with allocation(driver, 4096) as ptr:
                out = bytearray(4096)
                for round_ in range(200):
                    payload = bytes([index, round_ % 256]) * 2048
                    driver.memcpy_htod(ptr, memoryview(payload), 4096)
                    assert driver.ctx_get_current() == ctx
                    driver.memcpy_dtoh(memoryview(out), ptr, 4096)
                    assert out == payload
        except BaseException:
            start.abort()
            raise
        finally:
            driver.ctx_destroy(ctx)
        assert driver.ctx_get_current() is None

    threads = [HostThread(lambda index=index: worker(index)) for index in range(4)]
    for thread in threads:
        thread.join()


def test_destroyed_context_current_on_another_thread(driver: Driver) -> None:
    ctx = in_thread(lambda: driver.ctx_create(0, 0))
    pushed = threading.Event()
    destroyed = threading.Event()

    def other() -> None:
        driver.ctx_push(ctx)
        pushed.set()
        assert destroyed.wait(30)
        with raises_cuda("CUDA_ERROR_CONTEXT_IS_DESTROYED"):
            driver.mem_alloc(16)
        assert driver.ctx_get_current() == ctx, "destroy elsewhere does not pop this stack"
        assert driver.ctx_pop() == ctx

    thread = HostThread(other)
    pushed.wait(30)
    driver.ctx_destroy(ctx)
    destroyed.set()
    thread.join()


def test_api_version_and_unique_increasing_ids(driver: Driver) -> None:
    def body() -> None:
        primary = driver.primary_ctx_retain(0)
        one = driver.ctx_create(0, 0)
        two = driver.ctx_create(0, 0)
        try:
            ids = [driver.ctx_get_id(ctx) for ctx in (primary, one, two)]
            assert len(set(ids)) == 3
            assert ids[1] < ids[2]
            assert all(driver.ctx_get_api_version(ctx) == 3020 for ctx in (primary, one, two))
        finally:
            driver.ctx_destroy(two)
            driver.ctx_destroy(one)
            driver.primary_ctx_release(0)

    in_thread(body)


# --- memory --------------------------------------------------------------------------------


def test_memory_round_trips_with_offsets(driver: Driver) -> None:
    with primary_current(driver), allocation(driver, MIB) as ptr, allocation(driver, 4096) as other:
        driver.memset_d8(ptr, 0, MIB)
        driver.memcpy_htod(ptr + 100, memoryview(PATTERN), len(PATTERN))
        out = bytearray(356)
        driver.memcpy_dtoh(memoryview(out), ptr, len(out))
        assert out == bytes(100) + PATTERN

        driver.memset_d8(ptr + 1000, 0xAB, 10)
        window = bytearray(12)
        driver.memcpy_dtoh(memoryview(window), ptr + 999, 12)
        assert window == b"\0" + b"\xab" * 10 + b"\0"

        driver.memcpy_dtod(other + 7, ptr + 100, 256)
        copied = bytearray(4096)
        driver.memcpy_dtoh(memoryview(copied), other, 4096)
        assert copied[7:263] == PATTERN

        driver.memcpy_dtod(ptr + 500_000, ptr + 100, 256)
        tail = bytearray(256)
        driver.memcpy_dtoh(memoryview(tail), ptr + 500_000, 256)
        assert tail == PATTERN

        driver.ctx_synchronize()


def test_host_side_takes_any_buffer(driver: Driver) -> None:
    with primary_current(driver), allocation(driver, 64) as ptr:
        for source in (bytes(range(64)), bytearray(range(64)), memoryview(bytes(range(64)))):
            driver.memset_d8(ptr, 0, 64)
            driver.memcpy_htod(ptr, source, 64)  # type: ignore[arg-type]
            into = bytearray(64)
            driver.memcpy_dtoh(into, ptr, 64)  # type: ignore[arg-type]
            assert into == bytes(range(64))
        big = bytearray(100)
        driver.memcpy_dtoh(memoryview(big)[10:], ptr + 4, 60)
        assert big[10:70] == bytes(range(4, 64))
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.memcpy_dtoh(memoryview(bytes(64)), ptr, 64)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.memcpy_dtoh(memoryview(bytearray(8)), ptr, 64)


def test_large_memset_fills_every_byte(driver: Driver) -> None:
    size = 5 * MIB + 3
    with primary_current(driver), allocation(driver, size + 1) as ptr:
        driver.memset_d8(ptr + size, 0x11, 1)
        driver.memset_d8(ptr, 0x5A, size)
        out = bytearray(size + 1)
        driver.memcpy_dtoh(memoryview(out), ptr, size + 1)
        assert out == b"\x5a" * size + b"\x11", "every byte of the range set, none past it"


def test_access_past_the_end_is_invalid_value(driver: Driver) -> None:
    with primary_current(driver), allocation(driver, 1000) as ptr:
        host = bytearray(64)
        for call in (
            lambda: driver.memcpy_htod(ptr + 990, memoryview(host), 20),
            lambda: driver.memcpy_dtoh(memoryview(host), ptr + 990, 20),
            lambda: driver.memset_d8(ptr + 950, 1, 100),
            lambda: driver.memcpy_dtod(ptr, ptr + 990, 20),
            lambda: driver.memcpy_dtoh(memoryview(host), 0x10, 16),
        ):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                call()


def test_alloc_zero_is_invalid_value(driver: Driver) -> None:
    with primary_current(driver), raises_cuda("CUDA_ERROR_INVALID_VALUE"):
        driver.mem_alloc(0)


def test_alloc_beyond_the_device_is_out_of_memory(driver: Driver) -> None:
    total = driver.device_info(0).total_memory
    with primary_current(driver):
        for size in (total + 1, 1 << 50):
            with raises_cuda("CUDA_ERROR_OUT_OF_MEMORY"):
                driver.mem_alloc(size)


def test_free_of_a_bad_pointer_is_invalid_value(driver: Driver) -> None:
    with primary_current(driver):
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.mem_free(0x1234)
        ptr = driver.mem_alloc(4096)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.mem_free(ptr + 512)
        driver.mem_free(ptr)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            driver.mem_free(ptr)
        driver.mem_free(0)  # freeing NULL is a no-op, as in CUDA


def test_mem_get_info_follows_allocations(driver: Driver) -> None:
    with primary_current(driver):
        free_before, total = driver.mem_get_info()
        assert 0 < free_before <= total == driver.device_info(0).total_memory
        ptr = driver.mem_alloc(32 * MIB)
        free_during, total_during = driver.mem_get_info()
        assert total_during == total
        assert free_during <= free_before - 32 * MIB
        driver.mem_free(ptr)
        assert driver.mem_get_info()[0] > free_during


def test_destroy_frees_the_contexts_memory(driver: Driver) -> None:
    def body() -> None:
        with primary_current(driver):
            created = driver.ctx_create(0, 0)
            ptr = driver.mem_alloc(32 * MIB)
            free_during = driver.mem_get_info()[0]
            driver.ctx_destroy(created)
            assert driver.ctx_get_current() != created
            assert driver.mem_get_info()[0] >= free_during + 32 * MIB
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                driver.mem_free(ptr)

    in_thread(body)


def test_pointers_work_from_another_context_of_the_device(driver: Driver) -> None:
    def body() -> None:
        with primary_current(driver):
            ptr = driver.mem_alloc(256)
            driver.memcpy_htod(ptr, memoryview(PATTERN), 256)
            created = driver.ctx_create(0, 0)
            try:
                out = bytearray(256)
                driver.memcpy_dtoh(memoryview(out), ptr, 256)
                assert out == PATTERN
                driver.mem_free(ptr)
            finally:
                driver.ctx_destroy(created)

    in_thread(body)


def test_ipc_handle_identifies_the_allocation(driver: Driver) -> None:
    with primary_current(driver), allocation(driver, MIB) as ptr, allocation(driver, 4096) as other:
        handle = driver.ipc_get_mem_handle(ptr)
        assert isinstance(handle, bytes) and len(handle) == IPC_HANDLE_SIZE
        assert driver.ipc_get_mem_handle(ptr) == handle
        assert driver.ipc_get_mem_handle(ptr + 4096) == handle, "any pointer into the allocation"
        assert driver.ipc_get_mem_handle(other) != handle
        for bad in (0, 0x1234):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                driver.ipc_get_mem_handle(bad)

        def no_context() -> None:
            with raises_cuda("CUDA_ERROR_INVALID_CONTEXT"):
                driver.ipc_get_mem_handle(ptr)

        in_thread(no_context)


def test_devices_account_memory_separately(driver: Driver) -> None:
    if driver.device_count() < 2:
        pytest.skip("needs two devices")
    with primary_current(driver, 0):
        free_zero = driver.mem_get_info()[0]
    with primary_current(driver, 1):
        assert driver.ctx_get_device() == 1
        assert driver.mem_get_info()[1] == driver.device_info(1).total_memory
        ptr = driver.mem_alloc(64 * MIB)
        free_one = driver.mem_get_info()[0]
        with primary_current(driver, 0):
            assert abs(driver.mem_get_info()[0] - free_zero) < 32 * MIB
        driver.mem_free(ptr)
        assert driver.mem_get_info()[0] > free_one


# --- error names -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_error_table_matches_the_driver(cuda_bindings: Any) -> None:
    """cuctxd.protos.cuda_results must name and explain codes as the real driver does."""
    for result, message in DRIVER_MESSAGES.items():
        err, name = cuda_bindings.cuGetErrorName(cuda_bindings.CUresult(int(result)))
        assert err == cuda_bindings.CUresult.CUDA_SUCCESS
        assert name.decode() == result.name
        err, text = cuda_bindings.cuGetErrorString(cuda_bindings.CUresult(int(result)))
        assert err == cuda_bindings.CUresult.CUDA_SUCCESS
        assert text.decode() == message, result.name
