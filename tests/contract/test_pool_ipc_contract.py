"""The contract of IPC-capable pools and host registration, on every backend.

A pool made with ``ipc=True`` exports one fd; another process imports it once
and then each block from its 64 bytes of export data; both see the same bytes.
The child process here is a real one, given the fd with ``pass_fds``.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from cuctxd.daemon.backends.base import Driver
from cuctxd.protos.memfd import resize_sealed, sealed_memfd
from tests.helpers import REPO, client_env, primary_current, raises_cuda

SIZE = 1 << 20

CHILD = """
import sys
fd, backend, uuid, size = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
export = bytes.fromhex(sys.argv[5])
if backend == "sim":
    from cuctxd.client.data_plane.ipc_sim import SimPoolImport
    pool = SimPoolImport(fd, uuid)
    mapping = pool.import_pointer(export, size)
    seen = bytes(mapping.view[:8])
    mapping.view[8:16] = b"fromkid!"
else:
    from cuda.bindings import driver as cu
    from cuctxd.client.data_plane.ipc_cuda import CudaPoolImport
    pool = CudaPoolImport(fd, uuid)
    mapping = pool.import_pointer(export, size)
    from cuctxd.client.data_plane.ipc_cuda import ordinal_of
    device = ordinal_of(uuid)
    ctx = cu.cuDevicePrimaryCtxRetain(device)[1]
    cu.cuCtxPushCurrent(ctx)
    out = bytearray(8)
    assert cu.cuMemcpyDtoH(out, mapping.ptr, 8)[0] == 0
    seen = bytes(out)
    assert cu.cuMemcpyHtoD(mapping.ptr + 8, b"fromkid!", 8)[0] == 0
    assert cu.cuCtxSynchronize()[0] == 0
    cu.cuCtxPopCurrent()
    cu.cuDevicePrimaryCtxRelease(device)
mapping.close()
pool.close()
print(seen.hex())
"""


def _ipc_driver(driver: Driver) -> Driver:
    if not driver.pool_ipc_supported(0):
        pytest.skip(f"{driver.name} device 0 cannot export pools")
    return driver


def test_a_pool_block_is_shared_with_another_process(driver: Driver) -> None:
    _ipc_driver(driver)
    with primary_current(driver, 0):
        pool = driver.mem_pool_create(0, ipc=True)
        try:
            ptr = driver.mem_alloc_from_pool(SIZE, pool, None)
            driver.memcpy_htod(ptr, memoryview(b"fromdad!"), 8)
            driver.ctx_synchronize()
            export = driver.mem_pool_export_pointer(ptr)
            assert len(export) == 64
            fd = driver.mem_pool_export_fd(pool)
            try:
                child = subprocess.run(
                    [sys.executable, "-c", CHILD, str(fd), driver.name, driver.device_info(0).uuid, str(SIZE),
                     export.hex()],
                    pass_fds=(fd,), capture_output=True, text=True, timeout=120, env=client_env(), cwd=REPO)
            finally:
                os.close(fd)
            assert child.returncode == 0, child.stderr
            assert bytes.fromhex(child.stdout.strip()) == b"fromdad!"
            back = bytearray(16)
            driver.memcpy_dtoh(memoryview(back), ptr, 16)
            assert bytes(back) == b"fromdad!fromkid!"
            driver.mem_free_async(ptr, None)
            driver.ctx_synchronize()
        finally:
            driver.mem_pool_destroy(pool)


def test_export_of_memory_outside_an_ipc_pool_is_invalid(driver: Driver) -> None:
    _ipc_driver(driver)
    with primary_current(driver, 0):
        private = driver.mem_pool_create(0)
        shared = driver.mem_pool_create(0, ipc=True)
        legacy = driver.mem_alloc(4096)
        pooled = driver.mem_alloc_from_pool(4096, private, None)
        try:
            for ptr in (legacy, pooled):
                with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                    driver.mem_pool_export_pointer(ptr)
            with raises_cuda("CUDA_ERROR_INVALID_VALUE"):
                driver.mem_pool_export_fd(private)
            fd = driver.mem_pool_export_fd(shared)
            assert os.fstat(fd) is not None
            try:  # an importer cannot cut off memory the daemon touches (sim: a sealed memfd; cuda: no file)
                with pytest.raises(OSError):
                    os.ftruncate(fd, 0)
                if driver.name == "sim":
                    assert resize_sealed(fd)
            finally:
                os.close(fd)
        finally:
            driver.mem_free(legacy)
            driver.mem_free_async(pooled, None)
            driver.ctx_synchronize()
            driver.mem_pool_destroy(private)
            driver.mem_pool_destroy(shared)


def test_host_registration_of_a_shared_mapping(driver: Driver) -> None:
    fd = sealed_memfd("contract-host", SIZE)  # as the daemon makes a host buffer
    memory = mmap.mmap(fd, SIZE)
    os.close(fd)
    view = memoryview(memory)
    try:
        with primary_current(driver, 0):
            driver.host_register(view)
            try:
                with raises_cuda("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"):
                    driver.host_register(view)
                view[:5] = b"DMA'd"
                ptr = driver.mem_alloc(SIZE)
                driver.memcpy_htod(ptr, view, SIZE)
                view[:5] = b"\0" * 5
                driver.memcpy_dtoh(view[100:105], ptr, 5)
                assert bytes(view[100:105]) == b"DMA'd"
                driver.mem_free(ptr)
            finally:
                driver.host_unregister(view)
            with raises_cuda("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"):
                driver.host_unregister(view)
    finally:
        view.release()
        memory.close()
