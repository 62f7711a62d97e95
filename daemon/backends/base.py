"""The driver interface every backend implements: a thin, typed mirror of the CUDA driver API.

The device workers program against :class:`Driver` only, so the ``cuda`` and
``sim`` backends are interchangeable and the contract suite can run the same
sequences against both. Semantics are CUDA's: the context stack belongs to the
calling host thread, ``ctx_create`` pushes, calls that need a context use the
calling thread's current one, and every failure raises
:class:`cuctxd.protos.errors.CudaError` with CUDA's ``CUresult`` name and value.

Thread ownership: a worker calls these methods only from its own thread and
only for its own device; device queries may be called from any thread at start.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NewType

from cuctxd.protos.records import DeviceInfo

#: A backend's context object (``CUcontext`` for cuda); opaque to the daemon.
Ctx = NewType("Ctx", object)
#: A stream of the context that was current when it was made (``CUstream``).
Stream = NewType("Stream", object)
#: An event (``CUevent``).
Event = NewType("Event", object)
#: A stream-ordered memory pool of one device (``CUmemoryPool``).
Pool = NewType("Pool", object)

#: Bytes of an IPC memory handle (``CU_IPC_HANDLE_SIZE``); the sim's handles have the same size.
IPC_HANDLE_SIZE = 64


class Driver(ABC):
    """One process-wide driver instance; see the module docstring for the rules."""

    #: ``"cuda"`` or ``"sim"``, reported in ``hello`` and ``status``.
    name: str
    #: File descriptors this process holds for each pool made with ``ipc`` (:meth:`mem_pool_create`) while it
    #: lives: what the daemon's fd budget counts for it.
    ipc_pool_fds: int
    #: File descriptors this process keeps for a :meth:`vmm_alloc` allocation from its first :meth:`vmm_export_fd`
    #: until :meth:`vmm_free` (none where the driver keeps the memory without one).
    vmm_export_fds: int

    @abstractmethod
    def init(self) -> None:
        """``cuInit(0)``; must be called once before anything else."""

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_info(self, ordinal: int) -> DeviceInfo:
        """Name, UUID, PCI bus id, compute capability, memory and SM count of a device."""

    # --- primary context -----------------------------------------------------------

    @abstractmethod
    def primary_ctx_retain(self, ordinal: int) -> Ctx:
        """``cuDevicePrimaryCtxRetain``: one more reference; creates it when inactive."""

    @abstractmethod
    def primary_ctx_release(self, ordinal: int) -> None:
        """``cuDevicePrimaryCtxRelease``: the last release destroys it and its memory."""

    @abstractmethod
    def primary_ctx_state(self, ordinal: int) -> tuple[int, bool]:
        """``cuDevicePrimaryCtxGetState``: (flags, active)."""

    # --- context stack of the calling thread ------------------------------------------

    @abstractmethod
    def ctx_create(self, flags: int, ordinal: int) -> Ctx:
        """``cuCtxCreate``: a new context, pushed on the calling thread's stack."""

    @abstractmethod
    def ctx_destroy(self, ctx: Ctx) -> None:
        """``cuCtxDestroy``: frees the context's memory; pops it if it is current."""

    @abstractmethod
    def ctx_push(self, ctx: Ctx) -> None: ...

    @abstractmethod
    def ctx_pop(self) -> Ctx:
        """``cuCtxPopCurrent``; ``CUDA_ERROR_INVALID_CONTEXT`` on an empty stack."""

    @abstractmethod
    def ctx_set_current(self, ctx: Ctx | None) -> None:
        """``cuCtxSetCurrent``: replace the top of the stack (push if empty; None pops)."""

    @abstractmethod
    def ctx_get_current(self) -> Ctx | None: ...

    @abstractmethod
    def ctx_get_device(self) -> int:
        """Device of the current context; ``CUDA_ERROR_INVALID_CONTEXT`` without one."""

    @abstractmethod
    def ctx_get_flags(self) -> int:
        """Flags of the current context."""

    @abstractmethod
    def ctx_get_api_version(self, ctx: Ctx) -> int: ...

    @abstractmethod
    def ctx_get_id(self, ctx: Ctx) -> int:
        """``cuCtxGetId``: a process-unique id of the context."""

    @abstractmethod
    def ctx_synchronize(self) -> None:
        """Wait for all work in the current context."""

    # --- memory, in the current context ------------------------------------------------

    @abstractmethod
    def mem_alloc(self, size: int) -> int:
        """``cuMemAlloc``: a device pointer; size 0 is ``CUDA_ERROR_INVALID_VALUE``."""

    @abstractmethod
    def mem_free(self, ptr: int) -> None: ...

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current context's device."""

    @abstractmethod
    def memset_d8(self, ptr: int, value: int, size: int) -> None: ...

    @abstractmethod
    def memcpy_htod(self, dst: int, src: memoryview, size: int) -> None:
        """Copy ``size`` bytes from a host buffer to device memory."""

    @abstractmethod
    def memcpy_dtoh(self, dst: memoryview, src: int, size: int) -> None:
        """Copy ``size`` bytes of device memory into a writable host buffer."""

    @abstractmethod
    def memcpy_dtod(self, dst: int, src: int, size: int) -> None: ...

    # --- sharing ------------------------------------------------------------------------

    @abstractmethod
    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        """``cuIpcGetMemHandle``: the 64 bytes another process opens the allocation with."""

    # --- streams and events, in the current context ----------------------------------------
    # Work on a stream runs in order and asynchronously to the caller; the synchronous
    # memory calls above behave as on CUDA's legacy default stream: they wait for
    # earlier work on every blocking stream of the context, and that work waits for them.

    @abstractmethod
    def stream_create(self, non_blocking: bool = False) -> Stream:
        """``cuStreamCreate`` (``CU_STREAM_NON_BLOCKING`` when asked)."""

    @abstractmethod
    def stream_destroy(self, stream: Stream) -> None:
        """``cuStreamDestroy``: returns at once; queued work still completes."""

    @abstractmethod
    def stream_query(self, stream: Stream) -> bool:
        """``cuStreamQuery``: True when all work is done, False for ``CUDA_ERROR_NOT_READY``."""

    @abstractmethod
    def stream_synchronize(self, stream: Stream) -> None: ...

    @abstractmethod
    def event_create(self, timing: bool = True) -> Event:
        """``cuEventCreate``; ``timing=False`` is ``CU_EVENT_DISABLE_TIMING``."""

    @abstractmethod
    def event_destroy(self, event: Event) -> None: ...

    @abstractmethod
    def event_record(self, event: Event, stream: Stream | None) -> None:
        """``cuEventRecord``; ``None`` is the legacy default stream."""

    @abstractmethod
    def event_query(self, event: Event) -> bool:
        """True once the work before the record is done (an unrecorded event is done)."""

    @abstractmethod
    def event_synchronize(self, event: Event) -> None: ...

    @abstractmethod
    def event_elapsed_time(self, start: Event, end: Event) -> float:
        """Milliseconds between two completed, timed records; ``CUDA_ERROR_NOT_READY`` before."""

    @abstractmethod
    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` waits for ``event``'s record (``cuStreamWaitEvent``)."""

    @abstractmethod
    def memset_d8_async(self, ptr: int, value: int, size: int, stream: Stream | None) -> None: ...

    @abstractmethod
    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Stream | None) -> None:
        """The host buffer must stay alive and unchanged until the stream has passed the copy."""

    @abstractmethod
    def memcpy_dtoh_async(self, dst: Any, src: int, size: int, stream: Stream | None) -> None:
        """The host buffer must stay alive until the stream has passed the copy."""

    @abstractmethod
    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Stream | None) -> None: ...

    # --- stream-ordered allocation ----------------------------------------------------------

    @abstractmethod
    def mem_pool_create(self, ordinal: int, *, ipc: bool = False, max_size: int = 0) -> Pool:
        """A device pool that keeps freed memory cached for reuse (``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``
        at its maximum). ``ipc``: exportable to other processes (handle type
        ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``); ``CUDA_ERROR_NOT_SUPPORTED`` where
        :meth:`pool_ipc_supported` is False. ``max_size``: the most bytes the caller will ever
        allocate from it at once (0: no bound), so a backend may reserve no more (the sim sizes an
        IPC pool's shared memory by it; cuda leaves the driver's default)."""

    @abstractmethod
    def pool_ipc_supported(self, ordinal: int) -> bool:
        """Whether the device's pools can be exported as POSIX file descriptors
        (``CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES``); may be called from any thread."""

    @abstractmethod
    def mem_pool_export_fd(self, pool: Pool) -> int:
        """``cuMemPoolExportToShareableHandle``: a new file descriptor for an ``ipc`` pool, owned
        (and to be closed) by the caller; another process imports the pool from it once."""

    @abstractmethod
    def mem_pool_export_pointer(self, ptr: int) -> bytes:
        """``cuMemPoolExportPointer``: the 64 bytes (``CUmemPoolPtrExportData``) that name an
        allocation of an ``ipc`` pool to a process that imported the pool."""

    @abstractmethod
    def mem_pool_destroy(self, pool: Pool) -> None: ...

    @abstractmethod
    def mem_pool_trim(self, pool: Pool, keep: int) -> None:
        """``cuMemPoolTrimTo``: give cached memory above ``keep`` bytes back to the device."""

    @abstractmethod
    def mem_pool_cached(self, pool: Pool) -> int:
        """Bytes the pool holds but no allocation uses (reserved minus used): free for reuse."""

    @abstractmethod
    def mem_alloc_from_pool(self, size: int, pool: Pool, stream: Stream | None) -> int:
        """``cuMemAllocFromPoolAsync``: usable in stream order on ``stream``."""

    @abstractmethod
    def mem_free_async(self, ptr: int, stream: Stream | None) -> None:
        """``cuMemFreeAsync``: the memory returns to its pool in stream order."""

    # --- parking: memory an fd keeps alive past this process ----------------------------------

    @abstractmethod
    def mem_pool_import_fd(self, ordinal: int, fd: int) -> Pool:
        """``cuMemPoolImportFromShareableHandle``: the pool of device ``ordinal`` that ``fd`` (from
        :meth:`mem_pool_export_fd`, maybe of a process now gone) names; the caller keeps ``fd``. An imported
        pool allocates nothing; destroy it with :meth:`mem_pool_destroy` once its pointers are freed.
        ``CUDA_ERROR_INVALID_VALUE`` for an fd that is no such pool."""

    @abstractmethod
    def mem_pool_import_pointer(self, pool: Pool, export_data: bytes) -> int:
        """``cuMemPoolImportPointer``: the allocation of an imported pool that ``export_data`` (from
        :meth:`mem_pool_export_pointer`) names, freed with :meth:`mem_free_async` or :meth:`mem_free`
        before its pool is destroyed; ``CUDA_ERROR_INVALID_VALUE`` for data naming no live allocation."""

    @abstractmethod
    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        """``cuMemGetAddressRange``: (base, size) of the allocation holding ``ptr``."""

    @abstractmethod
    def mem_export_fd(self, ptr: int) -> int | None:
        """A new fd (the caller's) that keeps the :meth:`mem_alloc` allocation at ``ptr`` alive without
        this process, or None where there is none: ``cuMemAlloc`` memory (cuda) has no fd."""

    @abstractmethod
    def mem_import_fd(self, fd: int, size: int) -> int:
        """Map the ``size``-byte allocation ``fd`` (from :meth:`mem_export_fd`) keeps alive into the current
        context; the caller keeps ``fd``; free with :meth:`mem_free`. ``CUDA_ERROR_INVALID_VALUE`` for an
        fd of another kind or size, ``CUDA_ERROR_NOT_SUPPORTED`` where :meth:`mem_export_fd` gives None."""

    # --- virtual memory management: allocations an fd names -----------------------------------

    @abstractmethod
    def vmm_supported(self, ordinal: int) -> bool:
        """Whether the device can make VMM allocations exportable as POSIX fds
        (``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`` and
        ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``); may be called from any thread."""

    @abstractmethod
    def vmm_granularity(self, ordinal: int) -> int:
        """``cuMemGetAllocationGranularity`` (recommended) of a pinned, POSIX-fd-exportable allocation on the
        device: what :meth:`vmm_alloc` and :meth:`vmm_import_fd` sizes are multiples of; any thread."""

    @abstractmethod
    def vmm_alloc(self, ordinal: int, size: int) -> int:
        """``cuMemCreate`` of ``size`` bytes (a multiple of :meth:`vmm_granularity`) pinned on device ``ordinal``
        with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, then ``cuMemAddressReserve``, ``cuMemMap`` and
        ``cuMemSetAccess`` (read-write for the device): the mapped address, freed with :meth:`vmm_free`. Needs a
        current context (of that device). ``CUDA_ERROR_NOT_SUPPORTED`` where :meth:`vmm_supported` is False."""

    @abstractmethod
    def vmm_export_fd(self, ptr: int) -> int:
        """``cuMemExportToShareableHandle`` (POSIX fd) of the allocation :meth:`vmm_alloc` or :meth:`vmm_import_fd`
        mapped at ``ptr``: a new fd, the caller's, that keeps the memory alive in any process that holds it;
        ``CUDA_ERROR_INVALID_VALUE`` for any other pointer."""

    @abstractmethod
    def vmm_import_fd(self, ordinal: int, fd: int, size: int) -> int:
        """``cuMemImportFromShareableHandle`` of ``fd`` (from :meth:`vmm_export_fd`, maybe of a process now gone),
        reserved, mapped whole (``size`` bytes) and made read-write for device ``ordinal``; the caller keeps ``fd``;
        free with :meth:`vmm_free`. ``CUDA_ERROR_INVALID_VALUE`` for an fd of another kind or size."""

    @abstractmethod
    def vmm_free(self, ptr: int) -> None:
        """``cuMemUnmap``, ``cuMemAddressFree`` and ``cuMemRelease`` of what :meth:`vmm_alloc` or
        :meth:`vmm_import_fd` mapped at ``ptr`` (the physical memory goes once no process maps it and no fd of
        it is left); the caller has synchronised the work that uses it."""

    # --- pinned host memory -------------------------------------------------------------------

    @abstractmethod
    def mem_alloc_host(self, size: int) -> memoryview:
        """``cuMemAllocHost``: page-locked host memory as a writable memoryview (needs a context)."""

    @abstractmethod
    def mem_free_host(self, view: memoryview) -> None:
        """``cuMemFreeHost`` of memory from :meth:`mem_alloc_host`."""

    @abstractmethod
    def host_register(self, view: memoryview) -> None:
        """``cuMemHostRegister(..., CU_MEMHOSTREGISTER_PORTABLE)``: page-lock existing host memory (a
        shared mapping) for DMA from every context; the memory must stay mapped until
        :meth:`host_unregister`. ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` on overlap."""

    @abstractmethod
    def host_unregister(self, view: memoryview) -> None:
        """``cuMemHostUnregister`` of memory registered with :meth:`host_register`
        (``CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`` otherwise)."""
