"""The real backend: :class:`Driver` on the CUDA driver API through ``cuda.bindings.driver``.

Importing this module needs ``cuda-python`` but not the NVIDIA driver: the
bindings load ``libcuda.so`` on the first call, so without a driver every method
(``init`` first) raises a ``RuntimeError`` (``cuda.pathfinder``'s
``DynamicLibNotFoundError`` in cuda-bindings 13.4+); backend selection catches it.

Every driver result goes through :func:`check_result`, which raises
:class:`cuctxd.protos.errors.CudaError` with the driver's own ``CUresult`` value, name
and message. Contexts are the bindings' ``CUcontext`` objects, which compare and
hash by their native handle, so a worker can ask "is this one already current?"
with ``==``; device pointers leave and enter this module as plain ints.

Written for cuda-bindings 13.x (``cuCtxCreate`` takes a params argument); the
12.x two-argument ``cuCtxCreate`` is tried when the three-argument form is refused.
Thread ownership: as :mod:`cuctxd.daemon.backends.base` says; the shared mutable
state here, the ordinal -> ``CUdevice`` cache and the cache of pinned-array
types by size, only ever gains equal entries. Pinned host memory is owned by
whoever holds the view :meth:`CudaDriver.mem_alloc_host` returned (a device's
worker, for its read staging): the driver keeps no table of it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Any

from cuda.bindings.driver import (
    CU_MEMHOSTREGISTER_PORTABLE,
    CUcontext,
    CUdevice_attribute,
    CUevent_flags,
    CUmemAccess_flags,
    CUmemAccessDesc,
    CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType,
    CUmemAllocationProp,
    CUmemAllocationType,
    CUmemLocationType,
    CUmemPool_attribute,
    CUmemPoolProps,
    CUmemPoolPtrExportData,
    CUstream,
    CUstream_flags,
    cuCtxCreate,
    cuCtxDestroy,
    cuCtxGetApiVersion,
    cuCtxGetCurrent,
    cuCtxGetDevice,
    cuCtxGetFlags,
    cuCtxGetId,
    cuCtxPopCurrent,
    cuCtxPushCurrent,
    cuCtxSetCurrent,
    cuCtxSynchronize,
    cuDeviceGet,
    cuDeviceGetAttribute,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDeviceGetPCIBusId,
    cuDeviceGetUuid,
    cuDevicePrimaryCtxGetState,
    cuDevicePrimaryCtxRelease,
    cuDevicePrimaryCtxRetain,
    cuDeviceTotalMem,
    cuDriverGetVersion,
    cuEventCreate,
    cuEventDestroy,
    cuEventElapsedTime,
    cuEventQuery,
    cuEventRecord,
    cuEventSynchronize,
    cuGetErrorName,
    cuGetErrorString,
    cuInit,
    cuIpcGetMemHandle,
    cuMemAddressFree,
    cuMemAddressReserve,
    cuMemAlloc,
    cuMemAllocFromPoolAsync,
    cuMemAllocHost,
    cuMemcpyDtoD,
    cuMemcpyDtoDAsync,
    cuMemcpyDtoH,
    cuMemcpyDtoHAsync,
    cuMemcpyHtoD,
    cuMemcpyHtoDAsync,
    cuMemCreate,
    cuMemExportToShareableHandle,
    cuMemFree,
    cuMemFreeAsync,
    cuMemFreeHost,
    cuMemGetAddressRange,
    cuMemGetAllocationGranularity,
    cuMemGetInfo,
    cuMemHostRegister,
    cuMemHostUnregister,
    cuMemImportFromShareableHandle,
    cuMemMap,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemPoolExportPointer,
    cuMemPoolExportToShareableHandle,
    cuMemPoolGetAttribute,
    cuMemPoolImportFromShareableHandle,
    cuMemPoolImportPointer,
    cuMemPoolSetAttribute,
    cuMemPoolTrimTo,
    cuMemRelease,
    cuMemSetAccess,
    cuMemsetD8,
    cuMemsetD8Async,
    cuMemUnmap,
    cuStreamCreate,
    cuStreamDestroy,
    cuStreamQuery,
    cuStreamSynchronize,
    cuStreamWaitEvent,
    cuuint64_t,
)

from cuctxd.daemon.backends.base import IPC_HANDLE_SIZE, Ctx, Driver, Event, Pool, Stream
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.records import DeviceInfo

try:
    from cuda.bindings.utils import get_cuda_native_handle as _native_handle
except ImportError:  # cuda-bindings before 12.9.1

    def _native_handle(handle: Any) -> int:
        return int(handle)


log = logging.getLogger(__name__)

_NULL_CONTEXT = CUcontext(0)
_POSIX_FD = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_POOLS_SUPPORTED = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
_POOL_HANDLE_TYPES = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES
_VMM_SUPPORTED = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_VMM_POSIX_FD = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_CC_MAJOR = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
_CC_MINOR = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
_SM_COUNT = CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_NAME_LENGTH = 256
_PCI_BUS_ID_LENGTH = 64

#: code -> (name, message) as the driver itself reported them.
_error_text: dict[int, tuple[str, str]] = {}


def check_result(result: tuple[Any, ...]) -> Any:
    """Unwrap a driver call's ``(CUresult, *values)`` tuple.

    Returns None for ``(CUDA_SUCCESS,)``, the value for one, a tuple for several.
    Raises :class:`CudaError` (driver's code, name and message) on any other result.
    """
    err = result[0]
    if err:
        raise cuda_error(err)
    count = len(result)
    if count == 2:
        return result[1]
    return None if count == 1 else result[1:]


def cuda_error(err: Any) -> CudaError:
    """The :class:`CudaError` for a failed ``CUresult``, named and explained by the driver.

    When the driver cannot say (no driver loaded, a code it does not know), the
    name and message come from :mod:`cuctxd.protos.cuda_results`, or the bindings' enum name.
    """
    code = int(err)
    text = _error_text.get(code)
    if text is None:
        text = _driver_error_text(err)
        if text is None:
            return _table_error(err)
        _error_text[code] = text
    return CudaError(code, text[0], text[1])


def _driver_error_text(err: Any) -> tuple[str, str] | None:
    try:
        name_err, name = cuGetErrorName(err)
        if name_err or name is None:
            return None
        message_err, message = cuGetErrorString(err)
    except (RuntimeError, TypeError, ValueError) as lookup_failure:
        log.debug("cuGetErrorName(%d) failed, using the built-in table: %s", int(err), lookup_failure)
        return None
    name_text = name.decode(errors="replace")
    message_text = message.decode(errors="replace") if not message_err and message else name_text
    return name_text, message_text


def _table_error(err: Any) -> CudaError:
    code = int(err)
    try:
        return CudaError.of(CUresult(code))
    except ValueError:
        name = getattr(err, "name", None) or f"CUDA_ERROR_{code}"
        return CudaError(code, name, name)


def _invalid_value(detail: str) -> CudaError:
    return CudaError.of(CUresult.CUDA_ERROR_INVALID_VALUE, detail)


def _host_view(buffer: Any, size: int, *, writable: bool) -> memoryview:
    """``buffer`` as a contiguous view of at least ``size`` bytes, checked before the driver sees it.

    The bindings pass any buffer's address straight to the driver, read-only or
    short ones included; a check here keeps the daemon's own memory intact.
    """
    view = buffer if type(buffer) is memoryview else memoryview(buffer)
    if size < 0 or view.nbytes < size:
        raise _invalid_value(f"host buffer holds {view.nbytes} bytes, {size} requested")
    if not view.contiguous:
        raise _invalid_value("host buffer is not contiguous")
    if writable and view.readonly:
        raise _invalid_value("destination host buffer is read-only")
    return view


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as nvidia-smi prints them: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaDriver(Driver):
    """The CUDA driver of this process; one instance, shared by all device workers."""

    name = "cuda"
    #: Measured on an H100 (driver 580, 2026-12-06): each pool exportable as a POSIX fd holds one in the process.
    ipc_pool_fds = 1
    #: ``cuMemCreate`` memory needs no fd in the process: each export makes a new one, the caller's.
    vmm_export_fds = 0

    def __init__(self) -> None:
        self._devices: dict[int, Any] = {}
        #: Whether each device's pools can be exported (asked once; any thread may ask).
        self._pool_ipc: dict[int, bool] = {}
        #: Whether each device has VMM with POSIX fds, and its granularity (asked once each).
        self._vmm: dict[int, bool] = {}
        self._vmm_granularity: dict[int, int] = {}
        #: What vmm_alloc/vmm_import_fd mapped, by address: (CUmemGenericAllocationHandle, mapped size). Each
        #: worker adds and removes only its own device's addresses; the lock keeps the table whole.
        self._vmm_mappings: dict[int, tuple[Any, int]] = {}
        #: A copy of the fd each imported allocation came from, by address: what :meth:`vmm_export_fd` hands out
        #: for it (one fd held per re-adopted VMM share).
        self._vmm_imported: dict[int, int] = {}
        self._vmm_lock = threading.Lock()

    def init(self) -> None:
        check_result(cuInit(0))

    def driver_version(self) -> int:
        """``cuDriverGetVersion``, e.g. 13000 for CUDA 13.0 (for the selection log)."""
        return int(check_result(cuDriverGetVersion()))

    def device_count(self) -> int:
        return int(check_result(cuDeviceGetCount()))

    def _device(self, ordinal: int) -> Any:
        device = self._devices.get(ordinal)
        if device is None:
            device = self._devices[ordinal] = check_result(cuDeviceGet(ordinal))
        return device

    def device_info(self, ordinal: int) -> DeviceInfo:
        device = self._device(ordinal)
        return DeviceInfo(
            index=ordinal,
            name=_text(check_result(cuDeviceGetName(_NAME_LENGTH, device))),
            uuid=format_uuid(check_result(cuDeviceGetUuid(device)).bytes),
            pci_bus_id=_text(check_result(cuDeviceGetPCIBusId(_PCI_BUS_ID_LENGTH, device))),
            compute_capability=(
                int(check_result(cuDeviceGetAttribute(_CC_MAJOR, device))),
                int(check_result(cuDeviceGetAttribute(_CC_MINOR, device))),
            ),
            total_memory=int(check_result(cuDeviceTotalMem(device))),
            multiprocessor_count=int(check_result(cuDeviceGetAttribute(_SM_COUNT, device))),
        )

    # --- primary context -----------------------------------------------------------

    def primary_ctx_retain(self, ordinal: int) -> Ctx:
        return check_result(cuDevicePrimaryCtxRetain(self._device(ordinal)))

    def primary_ctx_release(self, ordinal: int) -> None:
        check_result(cuDevicePrimaryCtxRelease(self._device(ordinal)))

    def primary_ctx_state(self, ordinal: int) -> tuple[int, bool]:
        flags, active = check_result(cuDevicePrimaryCtxGetState(self._device(ordinal)))
        return int(flags), bool(active)

    # --- context stack of the calling thread ------------------------------------------

    def ctx_create(self, flags: int, ordinal: int) -> Ctx:
        device = self._device(ordinal)
        try:
            result = cuCtxCreate(None, flags, device)
        except TypeError as three_arguments_refused:
            try:
                result = cuCtxCreate(flags, device)  # cuda-bindings 12.x: (flags, dev)
            except TypeError:
                raise three_arguments_refused from None
        return check_result(result)

    def ctx_destroy(self, ctx: Ctx) -> None:
        check_result(cuCtxDestroy(ctx))

    def ctx_push(self, ctx: Ctx) -> None:
        check_result(cuCtxPushCurrent(ctx))

    def ctx_pop(self) -> Ctx:
        return check_result(cuCtxPopCurrent())

    def ctx_set_current(self, ctx: Ctx | None) -> None:
        check_result(cuCtxSetCurrent(_NULL_CONTEXT if ctx is None else ctx))

    def ctx_get_current(self) -> Ctx | None:
        ctx = check_result(cuCtxGetCurrent())
        return None if ctx is None or _native_handle(ctx) == 0 else ctx

    def ctx_get_device(self) -> int:
        return int(check_result(cuCtxGetDevice()))

    def ctx_get_flags(self) -> int:
        return int(check_result(cuCtxGetFlags()))

    def ctx_get_api_version(self, ctx: Ctx) -> int:
        return int(check_result(cuCtxGetApiVersion(ctx)))

    def ctx_get_id(self, ctx: Ctx) -> int:
        return int(check_result(cuCtxGetId(ctx)))

    def ctx_synchronize(self) -> None:
        check_result(cuCtxSynchronize())

    # --- memory, in the current context ------------------------------------------------

    def mem_alloc(self, size: int) -> int:
        return int(check_result(cuMemAlloc(size)))

    def mem_free(self, ptr: int) -> None:
        check_result(cuMemFree(ptr))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = check_result(cuMemGetInfo())
        return int(free), int(total)

    def memset_d8(self, ptr: int, value: int, size: int) -> None:
        if not 0 <= value <= 0xFF:
            raise _invalid_value(f"memset value {value} is not a byte")
        check_result(cuMemsetD8(ptr, value, size))

    def memcpy_htod(self, dst: int, src: memoryview, size: int) -> None:
        check_result(cuMemcpyHtoD(dst, _host_view(src, size, writable=False), size))

    def memcpy_dtoh(self, dst: memoryview, src: int, size: int) -> None:
        check_result(cuMemcpyDtoH(_host_view(dst, size, writable=True), src, size))

    def memcpy_dtod(self, dst: int, src: int, size: int) -> None:
        check_result(cuMemcpyDtoD(dst, src, size))

    # --- sharing ------------------------------------------------------------------------

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        # Copy the handle's 64 bytes through its pointer: ``.reserved`` is gone in 13.4+.
        handle = check_result(cuIpcGetMemHandle(ptr))
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)

    # --- streams and events ---------------------------------------------------------------

    def stream_create(self, non_blocking: bool = False) -> Stream:
        flags = CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else CUstream_flags.CU_STREAM_DEFAULT
        return check_result(cuStreamCreate(flags))  # type: ignore[no-any-return]

    def stream_destroy(self, stream: Stream) -> None:
        check_result(cuStreamDestroy(stream))

    def stream_query(self, stream: Stream) -> bool:
        return _done_or_not_ready(cuStreamQuery(stream))

    def stream_synchronize(self, stream: Stream) -> None:
        check_result(cuStreamSynchronize(stream))

    def event_create(self, timing: bool = True) -> Event:
        flags = CUevent_flags.CU_EVENT_DEFAULT if timing else CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check_result(cuEventCreate(flags))  # type: ignore[no-any-return]

    def event_destroy(self, event: Event) -> None:
        check_result(cuEventDestroy(event))

    def event_record(self, event: Event, stream: Stream | None) -> None:
        check_result(cuEventRecord(event, _stream(stream)))

    def event_query(self, event: Event) -> bool:
        return _done_or_not_ready(cuEventQuery(event))

    def event_synchronize(self, event: Event) -> None:
        check_result(cuEventSynchronize(event))

    def event_elapsed_time(self, start: Event, end: Event) -> float:
        return float(check_result(cuEventElapsedTime(start, end)))

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        check_result(cuStreamWaitEvent(stream, event, 0))

    def memset_d8_async(self, ptr: int, value: int, size: int, stream: Stream | None) -> None:
        if not 0 <= value <= 0xFF:
            raise _invalid_value(f"memset value {value} is not a byte")
        check_result(cuMemsetD8Async(ptr, value, size, _stream(stream)))

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Stream | None) -> None:
        check_result(cuMemcpyHtoDAsync(dst, _host_view(src, size, writable=False), size, _stream(stream)))

    def memcpy_dtoh_async(self, dst: Any, src: int, size: int, stream: Stream | None) -> None:
        check_result(cuMemcpyDtoHAsync(_host_view(dst, size, writable=True), src, size, _stream(stream)))

    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Stream | None) -> None:
        check_result(cuMemcpyDtoDAsync(dst, src, size, _stream(stream)))

    # --- stream-ordered allocation ------------------------------------------------------------

    def mem_pool_create(self, ordinal: int, *, ipc: bool = False, max_size: int = 0) -> Pool:
        if ipc and not self.pool_ipc_supported(ordinal):
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                               f"device {ordinal}'s pools cannot be exported as POSIX file descriptors")
        props = CUmemPoolProps()
        props.allocType = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = _POSIX_FD if ipc else CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ordinal
        pool = check_result(cuMemPoolCreate(props))
        try:
            # Keep freed memory cached: trimming happens explicitly (mem_pool_trim), not at every sync.
            threshold = cuuint64_t(0xFFFF_FFFF_FFFF_FFFF)
            check_result(cuMemPoolSetAttribute(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                               threshold))
            if ipc:
                # cuMemPoolExportPointer answers CUDA_ERROR_INVALID_VALUE until the pool itself has been
                # exported once (seen on driver 580): export it now, so every block can be at once.
                os.close(self.mem_pool_export_fd(pool))
        except BaseException:
            cuMemPoolDestroy(pool)
            raise
        return pool  # type: ignore[no-any-return]

    def pool_ipc_supported(self, ordinal: int) -> bool:
        supported = self._pool_ipc.get(ordinal)
        if supported is None:
            device = self._device(ordinal)
            supported = bool(check_result(cuDeviceGetAttribute(_POOLS_SUPPORTED, device))) and bool(
                int(check_result(cuDeviceGetAttribute(_POOL_HANDLE_TYPES, device))) & int(_POSIX_FD))
            self._pool_ipc[ordinal] = supported
        return supported

    def mem_pool_export_fd(self, pool: Pool) -> int:
        return int(check_result(cuMemPoolExportToShareableHandle(pool, _POSIX_FD, 0)))

    def mem_pool_export_pointer(self, ptr: int) -> bytes:
        # Copy the 64 bytes through the struct's pointer, as for IPC handles (no field to read them by).
        data = check_result(cuMemPoolExportPointer(ptr))
        return ctypes.string_at(data.getPtr(), IPC_HANDLE_SIZE)

    def mem_pool_destroy(self, pool: Pool) -> None:
        check_result(cuMemPoolDestroy(pool))

    def mem_pool_trim(self, pool: Pool, keep: int) -> None:
        check_result(cuMemPoolTrimTo(pool, keep))

    def mem_pool_cached(self, pool: Pool) -> int:
        reserved = check_result(cuMemPoolGetAttribute(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
        used = check_result(cuMemPoolGetAttribute(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT))
        return max(0, int(reserved) - int(used))

    def mem_alloc_from_pool(self, size: int, pool: Pool, stream: Stream | None) -> int:
        if size <= 0:  # the driver would return a NULL "allocation" for 0 bytes
            raise _invalid_value(f"allocation size {size}")
        return int(check_result(cuMemAllocFromPoolAsync(size, pool, _stream(stream))))

    def mem_free_async(self, ptr: int, stream: Stream | None) -> None:
        check_result(cuMemFreeAsync(ptr, _stream(stream)))

    # --- parking ---------------------------------------------------------------------------------

    def mem_pool_import_fd(self, ordinal: int, fd: int) -> Pool:
        # A POSIX fd goes by value where the C API takes a void*: the bindings take the int.
        return Pool(check_result(cuMemPoolImportFromShareableHandle(fd, _POSIX_FD, 0)))

    def mem_pool_import_pointer(self, pool: Pool, export_data: bytes) -> int:
        if len(export_data) != IPC_HANDLE_SIZE:
            raise _invalid_value(f"pool export data of {len(export_data)} bytes, not {IPC_HANDLE_SIZE}")
        # Written through the struct's pointer, as the IPC handle's bytes are read (no field to set them by).
        data = CUmemPoolPtrExportData()
        ctypes.memmove(data.getPtr(), export_data, IPC_HANDLE_SIZE)
        return int(check_result(cuMemPoolImportPointer(pool, data)))

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        base, size = check_result(cuMemGetAddressRange(ptr))
        return int(base), int(size)

    def mem_export_fd(self, ptr: int) -> int | None:
        return None  # cuMemAlloc memory has no shareable fd; only its legacy IPC handle

    def mem_import_fd(self, fd: int, size: int) -> int:
        raise CudaError.of(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                           "cuMemAlloc memory is never parked by an fd on cuda, so there is none to import")

    # --- virtual memory management ---------------------------------------------------------------

    def vmm_supported(self, ordinal: int) -> bool:
        supported = self._vmm.get(ordinal)
        if supported is None:
            device = self._device(ordinal)
            supported = bool(check_result(cuDeviceGetAttribute(_VMM_SUPPORTED, device))) and bool(
                check_result(cuDeviceGetAttribute(_VMM_POSIX_FD, device)))
            self._vmm[ordinal] = supported
        return supported

    def vmm_granularity(self, ordinal: int) -> int:
        granularity = self._vmm_granularity.get(ordinal)
        if granularity is None:
            recommended = CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            granularity = int(check_result(cuMemGetAllocationGranularity(_vmm_prop(ordinal), recommended)))
            self._vmm_granularity[ordinal] = granularity
        return granularity

    def vmm_alloc(self, ordinal: int, size: int) -> int:
        if not self.vmm_supported(ordinal):
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                               f"device {ordinal} has no VMM allocations exportable as POSIX file descriptors")
        self._check_vmm_size(ordinal, size)
        handle = check_result(cuMemCreate(size, _vmm_prop(ordinal), 0))
        try:
            return self._vmm_map(ordinal, handle, size)
        except BaseException:
            cuMemRelease(handle)
            raise

    def vmm_export_fd(self, ptr: int) -> int:
        with self._vmm_lock:
            mapping = self._vmm_mappings.get(ptr)
            imported = self._vmm_imported.get(ptr)
        if mapping is None:
            raise _invalid_value(f"{ptr:#x} is not the address of a VMM allocation of this process")
        if imported is not None:  # the driver will not export a handle it imported (H200: INVALID_VALUE)
            return os.dup(imported)
        return int(check_result(cuMemExportToShareableHandle(mapping[0], _POSIX_FD, 0)))

    def vmm_import_fd(self, ordinal: int, fd: int, size: int) -> int:
        self._check_vmm_size(ordinal, size)
        # A POSIX fd goes by value where the C API takes a void*, as for pools: the bindings take the int.
        handle = check_result(cuMemImportFromShareableHandle(fd, _POSIX_FD))
        try:
            ptr = self._vmm_map(ordinal, handle, size)
        except BaseException:
            cuMemRelease(handle)
            raise
        with self._vmm_lock:  # what vmm_export_fd hands out for it
            self._vmm_imported[ptr] = os.dup(fd)
        return ptr

    def vmm_free(self, ptr: int) -> None:
        with self._vmm_lock:
            mapping = self._vmm_mappings.pop(ptr, None)
            imported = self._vmm_imported.pop(ptr, None)
        if imported is not None:
            os.close(imported)
        if mapping is None:
            raise _invalid_value(f"{ptr:#x} is not the address of a VMM allocation of this process")
        handle, size = mapping
        try:
            check_result(cuMemUnmap(ptr, size))
            check_result(cuMemAddressFree(ptr, size))
        finally:
            check_result(cuMemRelease(handle))

    def _check_vmm_size(self, ordinal: int, size: int) -> None:
        granularity = self.vmm_granularity(ordinal)
        if size <= 0 or size % granularity:
            raise _invalid_value(f"VMM size {size} is not a positive multiple of the granularity {granularity}")

    def _vmm_map(self, ordinal: int, handle: Any, size: int) -> int:
        """Reserve ``size`` bytes of address space, map ``handle`` there whole and let the device read and write
        it; undone step by step if a step fails (the handle stays the caller's then)."""
        ptr = check_result(cuMemAddressReserve(size, self.vmm_granularity(ordinal), 0, 0))
        try:
            check_result(cuMemMap(ptr, size, 0, handle, 0))
            try:
                access = CUmemAccessDesc()
                access.location.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = ordinal
                access.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                check_result(cuMemSetAccess(ptr, size, [access], 1))
            except BaseException:
                cuMemUnmap(ptr, size)
                raise
        except BaseException:
            cuMemAddressFree(ptr, size)
            raise
        address = int(ptr)
        with self._vmm_lock:
            self._vmm_mappings[address] = (handle, size)
        return address

    # --- pinned host memory -------------------------------------------------------------------

    def mem_alloc_host(self, size: int) -> memoryview:
        """Page-locked memory, as a view whose exporter (a :class:`_Pinned` array) marks it as such:
        the caller that holds the view owns the memory, and nothing here keeps a record of it."""
        address = int(check_result(cuMemAllocHost(size)))
        return memoryview(_pinned_array(size).from_address(address)).cast("B")

    def host_register(self, view: memoryview) -> None:
        check_result(cuMemHostRegister(_address(view), view.nbytes, CU_MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, view: memoryview) -> None:
        check_result(cuMemHostUnregister(_address(view)))

    def mem_free_host(self, view: memoryview) -> None:
        try:
            array: Any = view.obj
        except ValueError as released:  # freed (and released) before
            raise _invalid_value("memory already freed") from released
        if not _is_pinned(array) or view.nbytes != ctypes.sizeof(array):
            raise _invalid_value("not memory from mem_alloc_host (or only part of it)")
        address = ctypes.addressof(array)
        view.release()
        check_result(cuMemFreeHost(address))


def _address(view: memoryview) -> int:
    """The address of a writable view (a mapping the caller keeps alive); the probe is dropped at once."""
    probe = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


class _Pinned:
    """Marks the ctypes arrays over page-locked memory that :meth:`CudaDriver.mem_alloc_host` made."""


def _is_pinned(exporter: object) -> bool:
    return isinstance(exporter, _Pinned)


@functools.cache
def _pinned_array(size: int) -> Any:
    """The ctypes array type of ``size`` bytes marked :class:`_Pinned` (one type per size: the staging
    buffers all have one size)."""
    return type(f"_Pinned{size}", (ctypes.c_char * size, _Pinned), {})


def _vmm_prop(ordinal: int) -> Any:
    """The ``CUmemAllocationProp`` of a VMM allocation: pinned on device ``ordinal``, exportable as a POSIX fd."""
    prop = CUmemAllocationProp()
    prop.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _POSIX_FD
    prop.location.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


_LEGACY_STREAM = CUstream(0)


def _stream(stream: Stream | None) -> Any:
    return _LEGACY_STREAM if stream is None else stream


def _done_or_not_ready(result: tuple[Any, ...]) -> bool:
    if int(result[0]) == CUresult.CUDA_ERROR_NOT_READY:
        return False
    check_result(result)
    return True
