"""Mapping a cuda-backend share in this process: a pool import and ``cuMemPoolImportPointer``, or a
legacy ``cuIpcOpenMemHandle``.

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


def _driver(purpose: str) -> Any:
    """``cuda.bindings.driver``, initialised; :class:`NotShareable` saying why this process cannot."""
    try:
        from cuda.bindings import driver as cu

        _check(cu.cuInit(0))
    except (ImportError, RuntimeError) as exc:
        raise NotShareable(f"this process cannot load the CUDA driver to {purpose}: {exc}") from exc
    return cu


def _find_device(cu: Any, uuid: str) -> Any:
    """This process's CUDA device with that UUID (ordinals differ between processes)."""
    for ordinal in range(_check(cu.cuDeviceGetCount())):
        device = _check(cu.cuDeviceGet(ordinal))
        if _uuid_of(cu, device) == uuid:
            return device
    raise NotShareable(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


class CudaMapping:
    """A device pointer to the shared allocation, valid in this process until :meth:`close`."""

    def __init__(self, descriptor: ShareDescriptor) -> None:
        self._cu = cu = _driver("map a cuda share")
        self._device = _find_device(cu, descriptor.device_uuid)
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

    def close(self) -> None:
        cu = self._cu
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            _check(cu.cuIpcCloseMemHandle(self.ptr))
        finally:
            _check(cu.cuCtxPopCurrent())
            _check(cu.cuDevicePrimaryCtxRelease(self._device))


class CudaPoolImport:
    """A daemon pool imported into this process (``cuMemPoolImportFromShareableHandle``) from the fd the
    fd channel delivered (the caller still closes it); its buffers are imported one by one with
    :meth:`import_pointer`, in this process's primary context of the same GPU."""

    def __init__(self, fd: int, device_uuid: str) -> None:
        self._cu = cu = _driver("map a cuda share")
        self._device = _find_device(cu, device_uuid)
        self._context = _check(cu.cuDevicePrimaryCtxRetain(self._device))
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            handle_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            self._pool = _check(cu.cuMemPoolImportFromShareableHandle(fd, handle_type, 0))
        except BaseException:
            _check(cu.cuCtxPopCurrent())
            _check(cu.cuDevicePrimaryCtxRelease(self._device))
            raise
        _check(cu.cuCtxPopCurrent())

    def import_pointer(self, export_data: bytes, size: int) -> CudaPoolMapping:
        """One buffer of the pool (``cuMemPoolImportPointer``, about 2 us)."""
        cu = self._cu
        data = cu.CUmemPoolPtrExportData()
        ctypes.memmove(data.getPtr(), export_data, len(export_data))
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            ptr = int(_check(cu.cuMemPoolImportPointer(self._pool, data)))
        finally:
            _check(cu.cuCtxPopCurrent())
        return CudaPoolMapping(cu, self._context, ptr)

    def close(self) -> None:
        """``cuMemPoolDestroy`` of the import, once its buffers are closed; then the primary's reference."""
        cu = self._cu
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            _check(cu.cuMemPoolDestroy(self._pool))
        finally:
            _check(cu.cuCtxPopCurrent())
            _check(cu.cuDevicePrimaryCtxRelease(self._device))


class CudaPoolMapping:
    """A buffer imported from a pool: ``ptr`` until :meth:`close` frees the import (before the owner frees)."""

    def __init__(self, cu: Any, context: Any, ptr: int) -> None:
        self._cu = cu
        self._context = context
        self.ptr = ptr

    def close(self) -> None:
        cu = self._cu
        _check(cu.cuCtxPushCurrent(self._context))
        try:
            _check(cu.cuMemFree(self.ptr))
        finally:
            _check(cu.cuCtxPopCurrent())


def copy_device_to_device(device_uuid: str, dst: int, src: int, size: int) -> None:
    """``cuMemcpyDtoD`` in this process's primary context of that GPU, finished before it returns
    (a layout's tensors copied into a daemon buffer mapped here)."""
    cu = _driver("copy device memory")
    device = _find_device(cu, device_uuid)
    context = _check(cu.cuDevicePrimaryCtxRetain(device))
    _check(cu.cuCtxPushCurrent(context))
    try:
        _check(cu.cuMemcpyDtoD(dst, src, size))
        _check(cu.cuCtxSynchronize())
    finally:
        _check(cu.cuCtxPopCurrent())
        _check(cu.cuDevicePrimaryCtxRelease(device))


def ordinal_of(device_uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with that UUID."""
    cu = _driver("find a GPU")
    for ordinal in range(_check(cu.cuDeviceGetCount())):
        if _uuid_of(cu, _check(cu.cuDeviceGet(ordinal))) == device_uuid:
            return ordinal
    raise NotShareable(f"GPU {device_uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")
