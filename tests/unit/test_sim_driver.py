"""What only the sim backend promises: its configuration, addresses, strictness and threads.

Behaviour shared with the real driver is in ``tests/contract``; this file covers
what the contract cannot pin on a GPU (capacity accounting to the byte, address
layout, refusing what the driver leaves undefined) and concurrent use.
"""

from __future__ import annotations

import mmap
import re
import threading
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from daemon.backends.base import Ctx
from daemon.backends.sim import CU_CTX_MAP_HOST, SimDriver
from daemon.backends.sim_memory import ALIGNMENT, AddressSpace, Allocation, Storage
from protos.errors import CudaError
from protos.sim_ipc import decode_handle, shm_dir

MIB = 1 << 20
CAPACITY = 8 * MIB


@contextmanager
def raises_cuda(name: str) -> Iterator[pytest.ExceptionInfo[CudaError]]:
    with pytest.raises(CudaError) as info:
        yield info
    assert info.value.name == name, f"expected {name}, got {info.value}"


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


def test_large_memset_fills_every_byte(sim: SimDriver) -> None:
    with created(sim):
        size = 5 * MIB + 3
        ptr = sim.mem_alloc(size)
        sim.memset_d8(ptr, 0x5A, size)
        assert read(sim, ptr, size) == b"\x5a" * size
        sim.mem_free(ptr)


def test_ipc_handle_names_a_shared_memory_file_with_the_bytes(sim: SimDriver) -> None:
    with created(sim, 1):
        ptr = sim.mem_alloc(1000)
        sim.memcpy_htod(ptr, memoryview(b"before"), 6)
        path = decode_handle(sim.ipc_get_mem_handle(ptr + 10))
        assert path.parent == shm_dir() and path.stat().st_size == 1000
        with path.open("r+b") as file, mmap.mmap(file.fileno(), 1000) as other_process:
            assert other_process[:6] == b"before", "exporting keeps the bytes"
            other_process[:5] = b"after"
            assert read(sim, ptr, 5) == b"after", "both sides see one memory"
            sim.memset_d8(ptr + 500, 7, 3)
            assert other_process[500:503] == b"\7\7\7"
        assert decode_handle(sim.ipc_get_mem_handle(ptr)) == path
        sim.mem_free(ptr)
        assert not path.exists(), "freeing removes the file"
        kept = sim.mem_alloc(64)
        kept_path = decode_handle(sim.ipc_get_mem_handle(kept))
    assert not kept_path.exists(), "destroying the context removes its files"


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


# --- threads -------------------------------------------------------------------------------


def test_concurrent_workers_keep_their_own_stack_and_data(sim: SimDriver) -> None:
    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(index: int) -> None:
        try:
            ctx = sim.ctx_create(0, index % 2)
            start.wait(10)
            ptr = sim.mem_alloc(4096)
            for round_ in range(200):
                payload = bytes([index, round_ % 256]) * 2048
                sim.memcpy_htod(ptr, memoryview(payload), 4096)
                assert sim.ctx_get_current() == ctx
                assert read(sim, ptr, 4096) == payload
            sim.mem_free(ptr)
            sim.ctx_destroy(ctx)
            assert sim.ctx_get_current() is None
        except BaseException as failure:
            failures.append(failure)
            start.abort()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not failures, failures
    with created(sim):
        assert sim.mem_get_info()[0] == CAPACITY
