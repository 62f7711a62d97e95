"""The few CUDA driver calls a client process makes to map shares, through ctypes on ``libcuda.so.1``.

A worker opening its first share used to import ``cuda.bindings.driver``: 20-30 ms on
the H200 host, 80-110 ms on a small VM, most of a fresh process's ``open_tensors``.
Loading libcuda itself takes about a millisecond. Names and signatures are
``cuda.h``'s (the ``_v2`` symbols its macros select). Which thread may call: any;
each call that needs a context pushes the primary one (:meth:`Driver.current`)
and pops it again.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from cuctxd.protos.errors import CudaError, NotShareable

#: ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`` and ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``.
IPC_LAZY_ENABLE_PEER_ACCESS = 1
HANDLE_TYPE_POSIX_FD = 1
#: ``CU_MEM_ALLOCATION_TYPE_PINNED``, ``CU_MEM_LOCATION_TYPE_DEVICE``, ``CU_MEM_ACCESS_FLAGS_PROT_READWRITE``,
#: ``CU_MEM_ALLOC_GRANULARITY_MINIMUM``.
ALLOCATION_TYPE_PINNED = 1
LOCATION_TYPE_DEVICE = 1
ACCESS_FLAGS_PROT_READWRITE = 3
ALLOC_GRANULARITY_MINIMUM = 0

_CUresult = ctypes.c_int
_CUdevice = ctypes.c_int
_CUcontext = ctypes.c_void_p
_CUdeviceptr = ctypes.c_uint64
_CUmemoryPool = ctypes.c_void_p
_CUstream = ctypes.c_void_p

#: Streams a device-to-device copy of many pieces spreads them over (:meth:`Driver.copy_device_to_device`).
COPY_STREAMS = 8
_CUmemGenericAllocationHandle = ctypes.c_ulonglong


class IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class PoolPtrExportData(ctypes.Structure):
    """``CUmemPoolPtrExportData``: 64 opaque bytes, passed by pointer."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: a type and an id (a union with the 2-byte ``localized`` form in CUDA 13.4+, same size)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp``, passed by pointer (32 bytes)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class MemAccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: a location and its ``CUmemAccess_flags``, passed by pointer."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


#: symbol -> argument types (every call returns CUresult).
_SIGNATURES: dict[str, list[type]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [_CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [_CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGet": [ctypes.POINTER(_CUdevice), ctypes.c_int],
    "cuDeviceGetUuid_v2": [ctypes.POINTER(_Uuid), _CUdevice],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_CUcontext), _CUdevice],
    "cuDevicePrimaryCtxRelease_v2": [_CUdevice],
    "cuCtxPushCurrent_v2": [_CUcontext],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_CUcontext)],
    "cuCtxSynchronize": [],
    "cuCtxGetDevice": [ctypes.POINTER(_CUdevice)],
    "cuMemcpyPeer": [_CUdeviceptr, _CUcontext, _CUdeviceptr, _CUcontext, ctypes.c_size_t],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_CUdeviceptr), IpcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_CUdeviceptr],
    "cuMemPoolImportFromShareableHandle": [ctypes.POINTER(_CUmemoryPool), ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_ulonglong],
    "cuMemPoolImportPointer": [ctypes.POINTER(_CUdeviceptr), _CUmemoryPool, ctypes.POINTER(PoolPtrExportData)],
    "cuMemPoolDestroy": [_CUmemoryPool],
    "cuMemFree_v2": [_CUdeviceptr],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(MemAllocationProp),
                                      ctypes.c_int],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_CUmemGenericAllocationHandle), ctypes.c_void_p, ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, _CUdeviceptr,
                            ctypes.c_ulonglong],
    "cuMemMap": [_CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, _CUmemGenericAllocationHandle, ctypes.c_ulonglong],
    "cuMemSetAccess": [_CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(MemAccessDesc), ctypes.c_size_t],
    "cuMemUnmap": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemAddressFree": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemRelease": [_CUmemGenericAllocationHandle],
    "cuMemcpyDtoD_v2": [_CUdeviceptr, _CUdeviceptr, ctypes.c_size_t],
    "cuStreamCreate": [ctypes.POINTER(_CUstream), ctypes.c_uint],
    "cuStreamDestroy_v2": [_CUstream],
    "cuMemcpyDtoDAsync_v2": [_CUdeviceptr, _CUdeviceptr, ctypes.c_size_t, _CUstream],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, _CUdeviceptr, ctypes.c_size_t],
    "cuMemcpyHtoD_v2": [_CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t],
}


class Driver:
    """libcuda's calls, checked: each raises :class:`CudaError` with CUDA's own name for a failure."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = _CUresult
        self.call("cuInit", 0)

    def call(self, name: str, *args: object) -> None:
        result = getattr(self._lib, name)(*args)
        if result:
            raise self.error(result, name)

    def error(self, result: int, call: str) -> CudaError:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.cuGetErrorName(result, ctypes.byref(name))
        self._lib.cuGetErrorString(result, ctypes.byref(text))
        return CudaError(result, (name.value or b"CUDA_ERROR_UNKNOWN").decode(),
                         f"{call}: {(text.value or b'').decode()}")

    def find_device(self, uuid: str) -> int:
        """This process's ordinal of the GPU with that UUID (ordinals differ between processes)."""
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        for ordinal in range(count.value):
            if self.device_uuid(ordinal) == uuid:
                return ordinal
        raise NotShareable(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")

    def device_uuid(self, ordinal: int) -> str:
        """The UUID (``GPU-...``, as ``nvidia-smi -L`` and the daemon's ``devices`` say) of this process's GPU
        ``ordinal``."""
        device, raw = _CUdevice(), _Uuid()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        self.call("cuDeviceGetUuid_v2", ctypes.byref(raw), device)
        h = ctypes.string_at(ctypes.addressof(raw), 16).hex()  # the field itself stops at a NUL
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def current_device(self) -> int:
        """This thread's current context's GPU (``cuCtxGetDevice``), or ordinal 0 without a current context (the
        runtime's default device, the first ``CUDA_VISIBLE_DEVICES`` names)."""
        device = _CUdevice()
        result = self._lib.cuCtxGetDevice(ctypes.byref(device))
        return device.value if result == 0 else 0

    def copy_peer(self, dst: int, dst_context: int, src: int, src_context: int, size: int) -> None:
        """``cuMemcpyPeer`` from ``src`` in ``src_context`` to ``dst`` in ``dst_context`` (two GPUs), then the
        current context synchronized."""
        self.call("cuMemcpyPeer", _CUdeviceptr(dst), _CUcontext(dst_context), _CUdeviceptr(src),
                  _CUcontext(src_context), size)
        self.call("cuCtxSynchronize")

    def retain_primary(self, device: int) -> int:
        context = _CUcontext()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        return context.value or 0

    def release_primary(self, device: int) -> None:
        self.call("cuDevicePrimaryCtxRelease_v2", device)

    @contextmanager
    def current(self, context: int) -> Iterator[None]:
        """``context`` current on this thread for the block (pushed, then popped whatever happens)."""
        self.call("cuCtxPushCurrent_v2", _CUcontext(context))
        try:
            yield
        finally:
            popped = _CUcontext()
            self.call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    def ipc_open(self, handle: bytes) -> int:
        raw = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, len(handle))
        ptr = _CUdeviceptr()
        self.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), raw, IPC_LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", _CUdeviceptr(ptr))

    def pool_import(self, fd: int) -> int:
        pool = _CUmemoryPool()
        self.call("cuMemPoolImportFromShareableHandle", ctypes.byref(pool), ctypes.c_void_p(fd),
                  HANDLE_TYPE_POSIX_FD, 0)
        return pool.value or 0

    def pool_import_pointer(self, pool: int, export_data: bytes) -> int:
        data = PoolPtrExportData()
        ctypes.memmove(ctypes.addressof(data), export_data, len(export_data))
        ptr = _CUdeviceptr()
        self.call("cuMemPoolImportPointer", ctypes.byref(ptr), _CUmemoryPool(pool), ctypes.byref(data))
        return ptr.value

    def pool_destroy(self, pool: int) -> None:
        self.call("cuMemPoolDestroy", _CUmemoryPool(pool))

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", _CUdeviceptr(ptr))

    def vmm_granularity(self, device: int) -> int:
        """``cuMemGetAllocationGranularity`` (minimum) of a pinned, POSIX-fd allocation on ``device``."""
        prop = MemAllocationProp(type=ALLOCATION_TYPE_PINNED, requestedHandleTypes=HANDLE_TYPE_POSIX_FD,
                                 location=MemLocation(LOCATION_TYPE_DEVICE, device))
        granularity = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop),
                  ALLOC_GRANULARITY_MINIMUM)
        return granularity.value

    def vmm_import(self, fd: int, size: int, device: int) -> tuple[int, int]:
        """(address, allocation handle) of the VMM allocation ``fd`` names (the caller keeps the fd), mapped whole
        (``size`` bytes) and made read-write for ``device``; undone step by step if a step fails."""
        handle = _CUmemGenericAllocationHandle()
        self.call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_TYPE_POSIX_FD)
        try:
            ptr = _CUdeviceptr()
            self.call("cuMemAddressReserve", ctypes.byref(ptr), size, self.vmm_granularity(device), _CUdeviceptr(0), 0)
            try:
                self.call("cuMemMap", ptr, size, 0, handle, 0)
                try:
                    access = MemAccessDesc(MemLocation(LOCATION_TYPE_DEVICE, device), ACCESS_FLAGS_PROT_READWRITE)
                    self.call("cuMemSetAccess", ptr, size, ctypes.byref(access), 1)
                except BaseException:
                    self._lib.cuMemUnmap(ptr, size)
                    raise
            except BaseException:
                self._lib.cuMemAddressFree(ptr, size)
                raise
        except BaseException:
            self._lib.cuMemRelease(handle)
            raise
        return ptr.value, handle.value

    def vmm_unmap(self, ptr: int, size: int, handle: int) -> None:
        """``cuMemUnmap``, ``cuMemAddressFree`` and ``cuMemRelease`` of what :meth:`vmm_import` mapped."""
        try:
            self.call("cuMemUnmap", _CUdeviceptr(ptr), size)
            self.call("cuMemAddressFree", _CUdeviceptr(ptr), size)
        finally:
            self.call("cuMemRelease", _CUmemGenericAllocationHandle(handle))

    def copy_device_to_device(self, pieces: Sequence[tuple[int, int, int]]) -> None:
        """``cuMemcpyDtoDAsync`` of each ``(dst, src, size)``, dealt round-robin over up to
        :data:`COPY_STREAMS` streams of the current context made for the call, then one ``cuCtxSynchronize``:
        every piece is written when this returns. The streams are blocking ones (flags 0): each waits for
        what the legacy stream had queued (the caller's own writes to the sources, as torch makes them).
        Several streams keep several copy engines busy: 300 pieces of 24 MiB took 7.5 ms on one stream and
        5.8 ms on eight on an H100, against 5.0 ms for one copy of the same 7 GiB."""
        streams: list[_CUstream] = []
        try:
            for _ in range(min(COPY_STREAMS, len(pieces))):
                stream = _CUstream()
                self.call("cuStreamCreate", ctypes.byref(stream), 0)
                streams.append(stream)
            for index, (dst, src, size) in enumerate(pieces):
                self.call("cuMemcpyDtoDAsync_v2", _CUdeviceptr(dst), _CUdeviceptr(src), size,
                          streams[index % len(streams)])
            self.call("cuCtxSynchronize")
        finally:
            for stream in streams:
                self._lib.cuStreamDestroy_v2(stream)

    def copy_to_host(self, host: int, src: int, size: int) -> None:
        """``cuMemcpyDtoH`` (synchronous) of ``size`` bytes at device ``src`` to the host address ``host``."""
        self.call("cuMemcpyDtoH_v2", ctypes.c_void_p(host), _CUdeviceptr(src), size)

    def copy_from_host(self, dst: int, host: int, size: int) -> None:
        """``cuMemcpyHtoD`` (synchronous) of ``size`` bytes at the host address ``host`` to device ``dst``."""
        self.call("cuMemcpyHtoD_v2", _CUdeviceptr(dst), ctypes.c_void_p(host), size)


_driver: Driver | None = None
_lock = threading.Lock()


def driver(purpose: str) -> Driver:
    """The process's :class:`Driver`, loaded and initialised once; :class:`NotShareable` saying why this
    process cannot (no libcuda, or ``cuInit`` fails)."""
    global _driver
    with _lock:
        if _driver is None:
            try:
                _driver = Driver(ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError, CudaError) as exc:
                raise NotShareable(f"this process cannot load the CUDA driver to {purpose}: {exc}") from exc
        return _driver
