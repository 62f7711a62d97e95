"""Mapping a cuda-backend share in this process with ``cuIpcOpenMemHandle``.

The mapping lives in this process's primary context of the same GPU (found by
UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering does not matter), which is the
context CuPy and PyTorch use too: the pointer works directly with them.
"""

from __future__ import annotations

import ctypes
from typing import Any

from cuctxd.protos.errors import CudaError, NotShareable
from cuctxd.protos.records import ShareDescriptor


def _check(result: tuple[Any, ...]) -> Any:
    from cuda.bindings import driver as cu

    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise CudaError(int(err), name.decode(), text.decode())
    return result[1] if len(result) == 2 else result[1:]


def _uuid_of(cu: Any, device: Any) -> str:
    raw = _check(cu.cuDeviceGetUuid(device)).bytes
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaMapping:
    """A device pointer to the shared allocation, valid in this process until :meth:`close`."""

    def __init__(self, descriptor: ShareDescriptor) -> None:
        try:
            from cuda.bindings import driver as cu

            _check(cu.cuInit(0))
        except (ImportError, RuntimeError) as exc:
            raise NotShareable(f"this process cannot load the CUDA driver to map a cuda share: {exc}") from exc
        self._cu = cu
        self._device = self._find_device(descriptor.device_uuid)
        self._context = _check(cu.cuDevicePrimaryCtxRetain(self._device))
        handle = cu.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), descriptor.ipc_handle, len(descriptor.ipc_handle))
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            self.ptr = int(_check(cu.cuIpcOpenMemHandle(handle, flags)))
        except CudaError:
            _check(cu.cuCtxPopCurrent())
            _check(cu.cuDevicePrimaryCtxRelease(self._device))
            raise
        _check(cu.cuCtxPopCurrent())

    def _find_device(self, uuid: str) -> Any:
        cu = self._cu
        for ordinal in range(_check(cu.cuDeviceGetCount())):
            device = _check(cu.cuDeviceGet(ordinal))
            if _uuid_of(cu, device) == uuid:
                return device
        raise NotShareable(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")

    def close(self) -> None:
        cu = self._cu
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            _check(cu.cuIpcCloseMemHandle(self.ptr))
        finally:
            _check(cu.cuCtxPopCurrent())
            _check(cu.cuDevicePrimaryCtxRelease(self._device))
