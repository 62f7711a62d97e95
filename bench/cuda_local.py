"""The in-process driver anchors: the bench process calling a driver itself, with no daemon.

:class:`LocalCuda` is ``cuda.bindings.driver`` in this process: ``cuInit``, the
primary context of the daemon's device (found by UUID) retained and made current
on the calling thread. :class:`LocalSim` is the sim backend's driver, in process,
for the figures whose anchor exists there too. Both belong to the thread that
made them (the bench's main thread): CUDA's current context is per thread.
"""

from __future__ import annotations

import ctypes
from typing import Any


class LocalDriverUnavailable(RuntimeError):
    """This process cannot drive the GPU itself; the figures needing it are skipped with this reason."""


def _check(result: tuple[Any, ...]) -> Any:
    from cuda.bindings import driver as cu

    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA call failed: {name.decode() if name else int(err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class LocalCuda:
    """The CUDA driver in this process, primary context of one device current on this thread."""

    name = "cuda"

    def __init__(self, device_uuid: str | None) -> None:
        try:
            from cuda.bindings import driver as cu

            _check(cu.cuInit(0))
        except (ImportError, RuntimeError) as exc:
            raise LocalDriverUnavailable(f"the bench process cannot use the CUDA driver: {exc}") from exc
        self.cu = cu
        self.device = self._find(device_uuid)
        self.context = _check(cu.cuDevicePrimaryCtxRetain(self.device))
        _check(cu.cuCtxSetCurrent(self.context))
        self._live: list[int] = []
        self._pinned: list[int] = []

    def _find(self, device_uuid: str | None) -> Any:
        cu = self.cu
        count = _check(cu.cuDeviceGetCount())
        for ordinal in range(count):
            device = _check(cu.cuDeviceGet(ordinal))
            if device_uuid is None or _uuid(_check(cu.cuDeviceGetUuid(device)).bytes) == device_uuid:
                return device
        raise LocalDriverUnavailable(f"the daemon's device {device_uuid} is not visible to the bench process")

    def alloc(self, size: int) -> int:
        return int(_check(self.cu.cuMemAlloc(size)))

    def free(self, ptr: int) -> None:
        _check(self.cu.cuMemFree(ptr))

    def htod(self, ptr: int, host: Any, size: int) -> None:
        _check(self.cu.cuMemcpyHtoD(ptr, host, size))

    def dtoh(self, host: Any, ptr: int, size: int) -> None:
        _check(self.cu.cuMemcpyDtoH(host, ptr, size))

    def dtod(self, dst: int, src: int, size: int) -> None:
        _check(self.cu.cuMemcpyDtoD(dst, src, size))

    def synchronize(self) -> None:
        _check(self.cu.cuCtxSynchronize())

    def pinned(self, size: int) -> memoryview:
        """``cuMemAllocHost`` memory as a writable view (freed with the primary context's release)."""
        address = int(_check(self.cu.cuMemAllocHost(size)))
        self._pinned.append(address)
        return memoryview((ctypes.c_char * size).from_address(address)).cast("B")

    def close(self) -> None:
        for address in self._pinned:
            _check(self.cu.cuMemFreeHost(address))
        _check(self.cu.cuCtxSetCurrent(self.cu.CUcontext(0)))
        _check(self.cu.cuDevicePrimaryCtxRelease(self.device))


class LocalSim:
    """The sim backend's driver in this process: the anchor for alloc+free (and the device-reading echo) on sim."""

    name = "sim"

    def __init__(self, memory: int = 1 << 30) -> None:
        from cuctxd.daemon.backends.sim import SimDriver

        self.driver = SimDriver(device_count=1, memory_per_device=memory)
        self.driver.init()
        self.context = self.driver.primary_ctx_retain(0)
        self.driver.ctx_set_current(self.context)

    def alloc(self, size: int) -> int:
        return self.driver.mem_alloc(size)

    def free(self, ptr: int) -> None:
        self.driver.mem_free(ptr)

    def htod(self, ptr: int, host: Any, size: int) -> None:
        self.driver.memcpy_htod(ptr, host, size)

    def dtoh(self, host: Any, ptr: int, size: int) -> None:
        self.driver.memcpy_dtoh(host, ptr, size)

    def close(self) -> None:
        self.driver.ctx_set_current(None)
        self.driver.primary_ctx_release(0)
