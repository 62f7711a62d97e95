"""The sim's side of parking: memory exported by one driver (a daemon that then dies) adopted by another."""

from __future__ import annotations

import gc
import os

from cuctxd.daemon.backends.sim import SimDriver
from tests.helpers import primary_current, raises_cuda

MIB = 1 << 20


def drivers() -> tuple[SimDriver, SimDriver]:
    old, new = SimDriver(1, 64 * MIB), SimDriver(1, 64 * MIB)
    old.init()
    new.init()
    return old, new


def test_a_pool_buffer_is_adopted_from_its_pool_fd_and_export_data() -> None:
    old, new = drivers()
    with primary_current(old):
        pool = old.mem_pool_create(0, ipc=True, max_size=2 * MIB)
        ptr = old.mem_alloc_from_pool(MIB, pool, None)
        old.memcpy_htod(ptr, b"weights" * 1000, 7000)
        fd, data = old.mem_pool_export_fd(pool), old.mem_pool_export_pointer(ptr)
    with primary_current(new):
        free = new.mem_get_info()[0]
        imported = new.mem_pool_import_fd(0, fd)
        os.close(fd)
        adopted = new.mem_pool_import_pointer(imported, data)
        assert new.mem_get_info()[0] == free - MIB  # counted against the device again
        assert new.mem_get_address_range(adopted + 10) == (adopted, MIB)
        out = bytearray(7000)
        new.memcpy_dtoh(out, adopted, 7000)
        assert bytes(out) == b"weights" * 1000
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            new.mem_pool_import_pointer(imported, data)  # that block is taken already
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            new.mem_alloc_from_pool(4096, imported, None)  # an imported pool allocates nothing
        new.mem_free_async(adopted, None)
        new.mem_pool_destroy(imported)
        assert new.mem_get_info()[0] == free


def test_a_legacy_buffer_is_adopted_from_its_memfd() -> None:
    old, new = drivers()
    with primary_current(old):
        ptr = old.mem_alloc(2 * MIB)
        old.memcpy_htod(ptr, b"x" * 100, 100)
        fd = old.mem_export_fd(ptr)
        assert fd is not None
    with primary_current(new):
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            new.mem_import_fd(fd, 4 * MIB)  # the size must match
        adopted = new.mem_import_fd(fd, 2 * MIB)
        os.close(fd)
        out = bytearray(100)
        new.memcpy_dtoh(out, adopted, 100)
        assert bytes(out) == b"x" * 100
        new.mem_free(adopted)


def test_a_vmm_allocation_is_exported_and_imported_by_its_fd() -> None:
    old, new = drivers()
    with primary_current(old):
        assert old.vmm_supported(0) and old.vmm_granularity(0) == 2 * MIB
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            old.vmm_alloc(0, 3 * MIB)  # not a multiple of the granularity
        free = old.mem_get_info()[0]
        ptr = old.vmm_alloc(0, 4 * MIB)
        assert old.mem_get_info()[0] == free - 4 * MIB
        old.memcpy_htod(ptr + MIB, b"vmm" * 100, 300)
        fd = old.vmm_export_fd(ptr)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            old.mem_free(ptr)  # VMM memory is unmapped and released, never cuMemFree'd
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            old.ipc_get_mem_handle(ptr)  # nor shared by a legacy IPC handle
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            old.vmm_export_fd(ptr + 4096)
        old.vmm_free(ptr)
        assert old.mem_get_info()[0] == free
    with primary_current(new):  # the fd alone kept the memory: the exporter freed its mapping
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            new.vmm_import_fd(0, fd, 2 * MIB)  # the size must match
        adopted = new.vmm_import_fd(0, fd, 4 * MIB)
        os.close(fd)
        out = bytearray(300)
        new.memcpy_dtoh(out, adopted + MIB, 300)
        assert bytes(out) == b"vmm" * 100
        new.vmm_free(adopted)
        with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
            new.vmm_free(adopted)


def open_fds() -> int:
    """This process's open memfds (the sim's VMM memory): other fds come and go with the test runner's own threads
    (pytest-xdist's channel to its main process)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:  # closed meanwhile (the listing's own fd, or another thread's)
            continue
    return found


def test_a_vmm_allocation_holds_no_fd_until_exported_then_one_memfd_of_its_size_until_freed() -> None:
    """As ``cuMemCreate`` memory holds no fd in the process: the sim's memfd is made by the first export."""
    gc.collect()  # earlier tests' drivers close their memfds when collected: not in the middle of this count
    gc.disable()
    try:
        counted_memfds()
    finally:
        gc.enable()


def counted_memfds() -> None:
    driver, _ = drivers()
    with primary_current(driver):
        fds = open_fds()
        ptrs = [driver.vmm_alloc(0, 2 * MIB) for _ in range(8)]
        assert open_fds() == fds
        driver.memcpy_htod(ptrs[0], b"before the export", 17)
        first, second = driver.vmm_export_fd(ptrs[0]), driver.vmm_export_fd(ptrs[0])
        assert os.fstat(first).st_ino == os.fstat(second).st_ino and os.fstat(first).st_size == 2 * MIB
        assert open_fds() == fds + 2 + driver.vmm_export_fds  # the two handed out, and what the sim keeps
        driver.memcpy_htod(ptrs[0] + 17, b", after", 7)
        with open(first, "rb", closefd=True) as memfd:
            assert memfd.read(24) == b"before the export, after"  # the bytes moved, and later writes land there
        os.close(second)
        for ptr in ptrs:
            driver.vmm_free(ptr)
        assert open_fds() == fds


def test_without_vmm_a_vmm_allocation_is_not_supported() -> None:
    driver = SimDriver(1, 64 * MIB, vmm=False)
    driver.init()
    with primary_current(driver):
        assert not driver.vmm_supported(0)
        with raises_cuda("CUDA_ERROR_NOT_SUPPORTED"):
            driver.vmm_alloc(0, 2 * MIB)


def test_an_fd_of_something_else_is_refused() -> None:
    _, new = drivers()
    read_end, write_end = os.pipe()
    try:
        with primary_current(new):
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                new.mem_pool_import_fd(0, read_end)
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                new.mem_import_fd(read_end, MIB)
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                new.vmm_import_fd(0, read_end, 2 * MIB)
    finally:
        os.close(read_end)
        os.close(write_end)
