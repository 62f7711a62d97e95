"""The sim backend: an in-process simulation of the CUDA driver, with real bytes.

It follows the real driver's rules so that code developed against it behaves the
same on a GPU; the contract suite (``tests/contract``) runs the same sequences on
both. Where behaviour is not obvious it was checked on an H200 (driver 580,
cuda-bindings 13.3):

* Every call before :meth:`SimDriver.init` raises ``CUDA_ERROR_NOT_INITIALIZED``;
  a bad ordinal raises ``CUDA_ERROR_INVALID_DEVICE``.
* Each host thread has its own context stack. With an empty stack, calls that need
  a context raise ``CUDA_ERROR_INVALID_CONTEXT`` and ``ctx_get_current`` is None.
* A destroyed context, or a primary context whose last reference was released,
  stays on the stacks it is on (``ctx_destroy`` pops it only from the calling
  thread's top). While it is current there, memory calls and ``ctx_synchronize``
  raise ``CUDA_ERROR_CONTEXT_IS_DESTROYED``, as does ``ctx_get_id``;
  ``ctx_get_api_version`` raises ``CUDA_ERROR_INVALID_CONTEXT``; ``ctx_get_device``,
  ``ctx_get_flags`` and ``ctx_pop`` still answer.
* The primary context of a device is one handle for the life of the process:
  ``primary_ctx_retain`` after the last release reactivates that same handle with a
  new ``ctx_get_id``, and a thread that still has it current can use it again.
  Releasing an unretained primary context and ``ctx_destroy`` of a primary context
  raise ``CUDA_ERROR_INVALID_CONTEXT``.
* Where the real driver's behaviour is undefined the sim refuses instead:
  ``ctx_destroy``, ``ctx_push`` or ``ctx_set_current`` of an already destroyed
  (non-primary) context raise ``CUDA_ERROR_INVALID_CONTEXT`` (the driver accepts
  the push and crashes on the next call); ``memcpy_dtoh`` into a read-only buffer
  raises ``CUDA_ERROR_INVALID_VALUE`` (the driver writes into immutable ``bytes``).
* Addressing is unified, as in CUDA: any live pointer can be copied to, from or
  freed with any live context current. One simplification: ``memcpy_dtod`` between
  two devices raises ``CUDA_ERROR_INVALID_VALUE`` (CUDA would copy).
* An access that starts outside every live allocation or runs past the end of its
  allocation raises ``CUDA_ERROR_INVALID_VALUE`` (the driver does the same for a
  range crossing an allocation's end; it only misses accesses that land in unused
  parts of its own 2 MiB pages). ``mem_free(0)`` is a no-op, as in CUDA.
* ``ipc_get_mem_handle`` gives the same 64 bytes for any pointer into one
  allocation: the path of the shared-memory file its bytes then live in. Memory
  from a stream-ordered pool is ``CUDA_ERROR_INVALID_VALUE``, as cuIpcGetMemHandle
  answers for it.
* Streams, events and the legacy default stream are in :mod:`cuctxd.daemon.backends.sim_streams`
  (its docstring has their rules): work on a stream runs asynchronously, in
  order, on that stream's own thread; the synchronous memory calls are
  legacy-stream work, waiting for the blocking streams of the current context;
  ``ctx_synchronize`` waits for every stream of the current context. Async calls
  check their arguments when called (``CUDA_ERROR_INVALID_VALUE``) and need a live
  current context, as the synchronous ones do; the stream may be of another
  context. Work that finds its memory freed by the time it runs reports
  ``CUDA_ERROR_ILLEGAL_ADDRESS`` at the next synchronisation, as a GPU would.
* Stream-ordered pools keep freed blocks cached for reuse, counted as used by
  ``mem_get_info``, until ``mem_pool_trim``, ``mem_pool_destroy`` or an allocation
  from the same pool that would otherwise run out of memory gives them back (the
  cuda backend sets the release threshold to the maximum, so CUDA keeps them too).
  ``mem_alloc_from_pool`` allocates at once, a valid stream order; a second free
  of a block is ``CUDA_ERROR_INVALID_VALUE``; ``mem_free`` of pool memory puts it
  back in its pool without waiting, and ``mem_free_async`` of ``mem_alloc`` memory
  frees it in stream order, as the driver does; a pool destroyed with blocks in
  use gives each back when it is freed. One refusal where the driver succeeds:
  ``mem_alloc_from_pool`` of 0 bytes is ``CUDA_ERROR_INVALID_VALUE``, like
  ``mem_alloc`` (the interface's choice; cuMemAllocFromPoolAsync gives NULL).
* ``mem_alloc_host`` maps page-aligned, zeroed memory owned by the current
  context; 0 bytes give an empty view (cuMemAllocHost gives NULL). Freeing a
  slice of it, other memory or it twice is ``CUDA_ERROR_INVALID_VALUE``.
* Copies and fills from 64 KiB move the bytes with the GIL released
  (:func:`cuctxd.daemon.backends.sim_memory.copy_bytes`), so a big copy on one thread
  never stalls the others.

Thread safety: any thread may call any method. Three locks guard the tables
and are never held together or while bytes are copied or work is waited for:
the driver's own (context ids and primary reference counts), that of
:class:`DeviceMemory` (allocations, pools, pinned memory) and that of the stream
scheduler (the order of work). A lifecycle lock, taken outside them, serialises
retaining, releasing and destroying contexts; the last two wait for the
context's queued work before its memory goes.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from cuctxd.daemon.backends.base import Ctx, Driver, Event, Pool, Stream
from cuctxd.daemon.backends.sim_contexts import SimContext, SimDevice, ThreadStacks
from cuctxd.daemon.backends.sim_memory import (
    DEVICE_SPAN,
    Allocation,
    DeviceMemory,
    SimPool,
    align_up,
    copy_bytes,
    fill_bytes,
    host_view,
)
from cuctxd.daemon.backends.sim_pools import HostRegistrations, PoolArena
from cuctxd.daemon.backends.sim_streams import StreamScheduler, Work
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.host import buffer_address
from cuctxd.protos.memfd import resize_sealed
from cuctxd.protos.records import DeviceInfo
from cuctxd.protos.sim_ipc import decode_pool_pointer, encode_handle, encode_pool_pointer

#: What ``cuCtxGetApiVersion`` reports on current drivers.
API_VERSION = 3020
#: ``CU_CTX_MAP_HOST``: the real driver reports it in an active primary context's flags.
CU_CTX_MAP_HOST = 0x08
#: All ``CUctx_flags`` bits; ``(flags & 0x07)`` must be one of the scheduling values.
_CTX_FLAGS_MASK = 0xFF
_SCHED_VALUES = (0x00, 0x01, 0x02, 0x04)
MAX_DEVICES = 16
#: What the sim's VMM allocations are multiples of (``cuMemGetAllocationGranularity`` on an H200).
VMM_GRANULARITY = 2 << 20

_INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
_INVALID_CONTEXT = CUresult.CUDA_ERROR_INVALID_CONTEXT
_CONTEXT_IS_DESTROYED = CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED
_ILLEGAL_ADDRESS = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS


class SimDriver(Driver):
    """A faithful in-process CUDA driver; see the module docstring for its rules.

    ``device_count`` (0 to 16; 0 makes :meth:`init` raise ``CUDA_ERROR_NO_DEVICE``)
    devices of ``memory_per_device`` bytes each. ``ipc_pools``: whether pools can be
    made IPC-capable (like a GPU whose ``MEMPOOL_SUPPORTED_HANDLE_TYPES`` has POSIX
    fds); without, sharing falls back to legacy IPC handles. ``vmm``: whether the devices
    have VMM allocations exportable as POSIX fds (:meth:`vmm_alloc`: private memory, as
    ``cuMemCreate`` holds no fd in the process, moved into a sealed memfd of exactly its size
    on its first :meth:`vmm_export_fd`, which hands out fds of it from then on).
    """

    name = "sim"
    #: A pool's memfd and its mapping (Python's ``mmap`` keeps a descriptor of its own); an exported VMM
    #: allocation's, likewise.
    ipc_pool_fds = 2
    vmm_export_fds = 2

    def __init__(self, device_count: int = 2, memory_per_device: int = 1 << 30, *, ipc_pools: bool = True,
                 vmm: bool = True) -> None:
        if not 0 <= device_count <= MAX_DEVICES:
            raise ValueError(f"device_count must be 0..{MAX_DEVICES}, got {device_count}")
        if not 0 < memory_per_device <= DEVICE_SPAN // 4:
            limit = DEVICE_SPAN // 4
            raise ValueError(f"memory_per_device must be 1..{limit} bytes, got {memory_per_device}")
        self._ipc_pools = ipc_pools
        self._vmm = vmm
        #: Addresses of the VMM allocations mapped here (vmm_alloc, vmm_import_fd), under ``_lock``.
        self._vmm_ptrs: set[int] = set()
        self._registered = HostRegistrations()
        self._devices = [SimDevice(ordinal, memory_per_device) for ordinal in range(device_count)]
        self._memory = DeviceMemory(memory_per_device, device_count)
        self._streams = StreamScheduler()
        self._lock = threading.Lock()
        self._lifecycle = threading.Lock()
        self._threads = ThreadStacks()
        self._context_ids = itertools.count(1)
        self._initialized = False
        #: Injected sticky errors by device: (calls left before it strikes, the error).
        self._faults: dict[int, tuple[int, CUresult]] = {}

    # --- init and devices ---------------------------------------------------------

    def init(self) -> None:
        """``cuInit(0)``: may be called again; ``CUDA_ERROR_NO_DEVICE`` with no devices."""
        if not self._devices:
            raise CudaError.of(CUresult.CUDA_ERROR_NO_DEVICE)
        self._initialized = True

    def device_count(self) -> int:
        self._check_initialized()
        return len(self._devices)

    def device_info(self, ordinal: int) -> DeviceInfo:
        return self._device(ordinal).info

    # --- primary context ----------------------------------------------------------

    def primary_ctx_retain(self, ordinal: int) -> Ctx:
        """One more reference; the first (again) activates the device's one handle with a new id."""
        device = self._device(ordinal)
        with self._lifecycle, self._lock:
            primary = device.primary
            if device.primary_refcount == 0:
                primary.context_id = next(self._context_ids)
                primary.flags = CU_CTX_MAP_HOST
                primary.alive = True
            device.primary_refcount += 1
        return Ctx(primary)

    def primary_ctx_release(self, ordinal: int) -> None:
        """The last release destroys the primary context's streams and events, frees its memory
        and deactivates it; it waits for the work queued on its streams first.

        It is not popped from any stack; ``CUDA_ERROR_INVALID_CONTEXT`` if not retained.
        """
        device = self._device(ordinal)
        with self._lifecycle:
            with self._lock:
                if device.primary_refcount == 0:
                    raise CudaError.of(_INVALID_CONTEXT, f"primary context of device {ordinal} is not retained")
                device.primary_refcount -= 1
                if device.primary_refcount > 0:
                    return
                primary = device.primary
                primary.alive = False
                primary.flags = 0
            self._retire(primary)

    def primary_ctx_state(self, ordinal: int) -> tuple[int, bool]:
        """(flags, active); the flags are the primary context's creation flags, 0 here."""
        device = self._device(ordinal)
        return 0, device.primary_refcount > 0

    # --- context stack of the calling thread -----------------------------------------

    def ctx_create(self, flags: int, ordinal: int) -> Ctx:
        """A new context, pushed on the calling thread's stack; bad flags are ``INVALID_VALUE``."""
        self._device(ordinal)
        if flags & ~_CTX_FLAGS_MASK or flags & 0x07 not in _SCHED_VALUES:
            raise CudaError.of(_INVALID_VALUE, f"context flags {flags:#x}")
        with self._lock:
            context_id = next(self._context_ids)
        context = SimContext(ordinal, flags, is_primary=False, context_id=context_id, alive=True)
        self._threads.stack.append(context)
        return Ctx(context)

    def ctx_destroy(self, ctx: Ctx) -> None:
        """Destroy a created context, its streams, events and memory; pop it if it is the caller's current one.

        Work queued on its streams completes first. Other threads keep it on their
        stacks (their calls then raise ``CUDA_ERROR_CONTEXT_IS_DESTROYED``).
        ``CUDA_ERROR_INVALID_CONTEXT`` for a primary context (release it instead) or
        one already destroyed.
        """
        context = self._context(ctx)
        if context.is_primary:
            raise CudaError.of(_INVALID_CONTEXT, "a primary context is released, not destroyed")
        with self._lifecycle:
            with self._lock:
                if not context.alive:
                    raise CudaError.of(_INVALID_CONTEXT, "context is already destroyed")
                context.alive = False
            self._retire(context)
        stack = self._threads.stack
        if stack and stack[-1] is context:
            stack.pop()

    def ctx_push(self, ctx: Ctx) -> None:
        self._threads.stack.append(self._pushable(ctx))

    def ctx_pop(self) -> Ctx:
        """Pop the calling thread's current context (even a destroyed one)."""
        self._check_initialized()
        stack = self._threads.stack
        if not stack:
            raise CudaError.of(_INVALID_CONTEXT, "the context stack of this thread is empty")
        return Ctx(stack.pop())

    def ctx_set_current(self, ctx: Ctx | None) -> None:
        """Replace the top of the stack (push if empty); None pops the top (no-op if empty)."""
        stack = self._threads.stack
        if ctx is None:
            self._check_initialized()
            if stack:
                stack.pop()
            return
        context = self._pushable(ctx)
        if stack:
            stack[-1] = context
        else:
            stack.append(context)

    def ctx_get_current(self) -> Ctx | None:
        self._check_initialized()
        stack = self._threads.stack
        return Ctx(stack[-1]) if stack else None

    def ctx_get_device(self) -> int:
        return self._current().device

    def ctx_get_flags(self) -> int:
        """The current context's flags (an active primary context reports ``CU_CTX_MAP_HOST``)."""
        return self._current().flags

    def ctx_get_api_version(self, ctx: Ctx) -> int:
        """3020; a destroyed context is ``CUDA_ERROR_INVALID_CONTEXT``. None means the current one."""
        context = self._current() if ctx is None else self._context(ctx)
        if not context.alive:
            raise CudaError.of(_INVALID_CONTEXT, "context is destroyed")
        return API_VERSION

    def ctx_get_id(self, ctx: Ctx) -> int:
        """Process-unique, increasing; a destroyed context is ``CUDA_ERROR_CONTEXT_IS_DESTROYED``."""
        context = self._current() if ctx is None else self._context(ctx)
        if not context.alive:
            raise CudaError.of(_CONTEXT_IS_DESTROYED)
        return context.context_id

    def ctx_synchronize(self) -> None:
        """Wait for all streams of the current context, raising the first error their work met."""
        self._streams.synchronize_context(self._live_current())

    # --- memory, in the current context ------------------------------------------------

    def mem_alloc(self, size: int) -> int:
        """A zero-filled allocation in the current context; 512-byte aligned, accounted in 512s."""
        context = self._live_current()
        return self._memory.allocate(context.device, size, context)

    def mem_free(self, ptr: int) -> None:
        """Free an allocation by its base pointer, from any live context; 0 is a no-op.

        Pool memory goes back to its pool at once (cuMemFree does not synchronise for
        it); other memory is freed as legacy-stream work, since cudaFree synchronises.
        """
        context = self._live_current()
        if ptr == 0:
            return
        if self._is_vmm(ptr):
            raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is VMM memory: unmap and release it (vmm_free)")
        allocation = self._memory.claim(ptr)
        if allocation.pool is None:
            self._streams.run_legacy(context, partial(self._memory.release, allocation))
        else:
            self._memory.release(allocation)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total); memory cached in pools counts as used, as in CUDA."""
        return self._memory.info(self._live_current().device)

    def memset_d8(self, ptr: int, value: int, size: int) -> None:
        self._streams.run_legacy(self._live_current(), self._memset_work(ptr, value, size))

    def memcpy_htod(self, dst: int, src: memoryview | bytes | bytearray, size: int) -> None:
        """Copy from any buffer-protocol object (a non-buffer raises ``TypeError``)."""
        self._streams.run_legacy(self._live_current(), self._htod_work(dst, src, size))

    def memcpy_dtoh(self, dst: memoryview | bytearray, src: int, size: int) -> None:
        """Copy into a writable buffer; a read-only one is ``CUDA_ERROR_INVALID_VALUE``."""
        self._streams.run_legacy(self._live_current(), self._dtoh_work(dst, src, size))

    def memcpy_dtod(self, dst: int, src: int, size: int) -> None:
        """Copy within one device (overlap behaves like memmove); across devices ``INVALID_VALUE``."""
        self._streams.run_legacy(self._live_current(), self._dtod_work(dst, src, size))

    # --- sharing ----------------------------------------------------------------------

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        """The same 64 bytes for any pointer into one live allocation: the path of its memfd.

        The first call moves the allocation's bytes into a memfd, named by its
        ``/proc/<pid>/fd/<n>`` path (:mod:`cuctxd.protos.sim_ipc`); freeing the allocation closes it.
        It runs as legacy-stream work, so no queued copy writes to the old bytes.
        Needs a live current context; a pointer outside every live allocation, or
        into pool memory, is ``CUDA_ERROR_INVALID_VALUE``, as on the real driver;
        ``CUDA_ERROR_MAP_FAILED`` if the memfd cannot be made.
        """
        context = self._live_current()
        allocation, _ = self._memory.resolve(ptr, 0)
        if allocation.pool is not None or self._is_vmm(allocation.base):
            raise CudaError.of(_INVALID_VALUE, "memory from a stream-ordered pool or VMM has no legacy IPC handle")
        try:
            return encode_handle(self._streams.run_legacy(context, partial(self._memory.export, allocation)))
        except (OSError, ValueError) as failure:
            raise CudaError.of(CUresult.CUDA_ERROR_MAP_FAILED, str(failure)) from failure

    # --- streams and events ----------------------------------------------------------------

    def stream_create(self, non_blocking: bool = False) -> Stream:
        """A stream of the current context; its executor thread starts with its first work."""
        return Stream(self._streams.create_stream(self._live_current(), non_blocking))

    def stream_destroy(self, stream: Stream) -> None:
        """Returns at once; queued work still completes, then the stream's thread ends."""
        self._check_initialized()
        self._streams.destroy_stream(stream)

    def stream_query(self, stream: Stream) -> bool:
        """True when all its work is done; raises (once) the first error its work met."""
        self._check_initialized()
        return self._streams.query(stream)

    def stream_synchronize(self, stream: Stream) -> None:
        """Wait for the work queued so far; raises (once) the first error its work met."""
        self._check_initialized()
        self._streams.synchronize(stream)

    def event_create(self, timing: bool = True) -> Event:
        return Event(self._streams.create_event(self._live_current(), timing))

    def event_destroy(self, event: Event) -> None:
        self._check_initialized()
        self._streams.destroy_event(event)

    def event_record(self, event: Event, stream: Stream | None) -> None:
        """Record on a stream of the event's context; ``None`` needs that context current."""
        self._check_initialized()
        self._streams.record(event, stream, self._live_current() if stream is None else None)

    def event_query(self, event: Event) -> bool:
        self._check_initialized()
        return self._streams.event_query(event)

    def event_synchronize(self, event: Event) -> None:
        self._check_initialized()
        self._streams.event_synchronize(event)

    def event_elapsed_time(self, start: Event, end: Event) -> float:
        """Milliseconds between the completions of the two records.

        As cuEventElapsedTime: ``CUDA_ERROR_INVALID_HANDLE`` if either event has timing
        disabled or was never recorded, ``CUDA_ERROR_NOT_READY`` while either record is pending.
        """
        self._check_initialized()
        return self._streams.elapsed_ms(start, end)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """A no-op for an event never recorded; the event may be of another context."""
        self._check_initialized()
        self._streams.wait_event(stream, event)

    def launch_host_func(self, stream: Stream | None, func: Callable[[], object]) -> None:
        """``cuLaunchHostFunc``: run ``func`` on the stream's thread when the stream reaches it.

        Not part of :class:`Driver`: the sim offers it so that tests can hold a stream
        busy for exactly as long as they need. An exception from ``func`` is the
        stream's error (``CUDA_ERROR_UNKNOWN`` unless it is a :class:`CudaError`).
        """
        self._streams.submit(self._live_current(), stream, func)

    def memset_d8_async(self, ptr: int, value: int, size: int, stream: Stream | None) -> None:
        self._streams.submit(self._live_current(), stream, self._memset_work(ptr, value, size))

    def memcpy_htod_async(self, dst: int, src: Any, size: int, stream: Stream | None) -> None:
        self._streams.submit(self._live_current(), stream, self._htod_work(dst, src, size))

    def memcpy_dtoh_async(self, dst: Any, src: int, size: int, stream: Stream | None) -> None:
        self._streams.submit(self._live_current(), stream, self._dtoh_work(dst, src, size))

    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Stream | None) -> None:
        self._streams.submit(self._live_current(), stream, self._dtod_work(dst, src, size))

    # --- stream-ordered allocation --------------------------------------------------------

    def mem_pool_create(self, ordinal: int, *, ipc: bool = False, max_size: int = 0) -> Pool:
        """A pool of the device; a bad ordinal is ``CUDA_ERROR_INVALID_VALUE`` (a bad pool location).
        ``ipc``: its blocks live in one shared memfd (sparse) of ``max_size`` bytes, or of twice the
        device's memory without one."""
        self._check_initialized()
        if not 0 <= ordinal < len(self._devices):
            raise CudaError.of(_INVALID_VALUE, f"no device {ordinal} to place a pool on")
        if not ipc:
            return Pool(SimPool(ordinal))
        if not self._ipc_pools:
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_SUPPORTED, "this sim driver was made with ipc_pools=False")
        try:
            arena = PoolArena(align_up(max_size) if max_size else 2 * self._memory.capacity)
        except OSError as failure:
            raise CudaError.of(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"the pool's shared memory: {failure}") from None
        return Pool(SimPool(ordinal, arena))

    def pool_ipc_supported(self, ordinal: int) -> bool:
        return self._ipc_pools

    def mem_pool_destroy(self, pool: Pool) -> None:
        """Give the cached memory back now; blocks still in use go back to the device when freed."""
        sim_pool = self._pool(pool)
        sim_pool.alive = False
        self._memory.pool_trim(sim_pool, 0)
        if sim_pool.arena is not None:
            sim_pool.arena.close()

    def mem_pool_export_fd(self, pool: Pool) -> int:
        """A new fd of an IPC-capable pool's memfd; ``CUDA_ERROR_INVALID_VALUE`` for another pool (an imported
        one too)."""
        sim_pool = self._pool(pool)
        arena = sim_pool.arena
        if arena is None or sim_pool.imported:
            raise CudaError.of(_INVALID_VALUE, "the pool was not made IPC-capable")
        return arena.export_fd()

    def mem_pool_export_pointer(self, ptr: int) -> bytes:
        """The block's offset and size in its pool's memfd (:func:`cuctxd.protos.sim_ipc.encode_pool_pointer`)."""
        self._live_current()
        return encode_pool_pointer(*self._memory.export_pointer(ptr))

    def mem_pool_trim(self, pool: Pool, keep: int) -> None:
        sim_pool = self._pool(pool)
        if keep < 0:
            raise CudaError.of(_INVALID_VALUE, f"bytes to keep {keep}")
        self._memory.pool_trim(sim_pool, keep)

    def mem_pool_cached(self, pool: Pool) -> int:
        return self._pool(pool).cached_bytes

    def mem_alloc_from_pool(self, size: int, pool: Pool, stream: Stream | None) -> int:
        """A cached block of the same 512-rounded size if there is one, else a new one.

        Allocated at once, which is a valid stream order. The pool's device pays for
        it; when that device is full the pool first gives back its other cached
        blocks, then it is ``CUDA_ERROR_OUT_OF_MEMORY``. Size 0 is ``INVALID_VALUE``.
        """
        self._live_current()
        self._streams.check_stream(stream)
        sim_pool = self._pool(pool)
        if sim_pool.imported:
            raise CudaError.of(_INVALID_VALUE, "an imported pool allocates nothing")
        return self._memory.pool_allocate(sim_pool, size)

    def mem_free_async(self, ptr: int, stream: Stream | None) -> None:
        """Free when the stream reaches this point (at once if it is idle); 0 is a no-op.

        Pool memory goes back to its pool's cache, other memory to the device. From
        this call on the pointer is refused (``CUDA_ERROR_INVALID_VALUE``).
        """
        context = self._live_current()
        idle = self._streams.is_idle(context, stream)
        if ptr == 0:
            return
        allocation = self._memory.claim(ptr)
        if idle:
            self._memory.release(allocation)
        else:
            self._streams.submit(context, stream, partial(self._memory.release, allocation))

    # --- parking ---------------------------------------------------------------------------------

    def mem_pool_import_fd(self, ordinal: int, fd: int) -> Pool:
        """The pool whose memfd ``fd`` is (sealed against resizing, as every pool's): mapped whole, with no block
        in use until :meth:`mem_pool_import_pointer`; anything else is ``CUDA_ERROR_INVALID_VALUE``."""
        self._check_initialized()
        if not 0 <= ordinal < len(self._devices):
            raise CudaError.of(_INVALID_VALUE, f"no device {ordinal} to import a pool on")
        if not resize_sealed(fd):
            raise CudaError.of(_INVALID_VALUE, "the fd is not a sim pool's memory (a sealed memfd)")
        span = os.fstat(fd).st_size
        if span <= 0:
            raise CudaError.of(_INVALID_VALUE, "the pool's memory is empty")
        try:
            arena = PoolArena(span, os.dup(fd))  # closes its fd if it cannot map it
        except OSError as failure:
            raise CudaError.of(_INVALID_VALUE, f"cannot map the pool's memory: {failure}") from None
        return Pool(SimPool(ordinal, arena, imported=True))

    def mem_pool_import_pointer(self, pool: Pool, export_data: bytes) -> int:
        """The block ``export_data`` names (:func:`cuctxd.protos.sim_ipc.decode_pool_pointer`) of an imported pool,
        counted against its device as the exporter's was; ``CUDA_ERROR_INVALID_VALUE`` for a block that is
        not free in it, or data of another kind."""
        self._live_current()
        sim_pool = self._pool(pool)
        if not sim_pool.imported:
            raise CudaError.of(_INVALID_VALUE, "the pool was not imported")
        try:
            offset, size = decode_pool_pointer(export_data)
        except ValueError as failure:
            raise CudaError.of(_INVALID_VALUE, str(failure)) from None
        return self._memory.pool_import(sim_pool, offset, size)

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        self._live_current()
        allocation, _ = self._memory.resolve(ptr, 0)
        return allocation.base, allocation.size

    def mem_export_fd(self, ptr: int) -> int | None:
        """A new fd of the memfd holding the allocation at ``ptr`` (moved there as :meth:`ipc_get_mem_handle` does)."""
        context = self._live_current()
        allocation, _ = self._memory.resolve(ptr, 0)
        if allocation.pool is not None or self._is_vmm(allocation.base):
            raise CudaError.of(_INVALID_VALUE, "memory from a stream-ordered pool or VMM is parked by its own fd")
        return self._export_memfd(context, allocation)

    def mem_import_fd(self, fd: int, size: int) -> int:
        """The memfd ``fd`` (of exactly ``size`` bytes, sealed) as an allocation of the current context."""
        context = self._live_current()
        if not resize_sealed(fd):
            raise CudaError.of(_INVALID_VALUE, "the fd is not sim device memory (a sealed memfd)")
        if size <= 0 or os.fstat(fd).st_size != size:
            raise CudaError.of(_INVALID_VALUE, f"the memory is {os.fstat(fd).st_size} bytes, not {size}")
        return self._memory.adopt(context.device, os.dup(fd), size, context)

    # --- virtual memory management -------------------------------------------------------------

    def vmm_supported(self, ordinal: int) -> bool:
        self._device(ordinal)
        return self._vmm

    def vmm_granularity(self, ordinal: int) -> int:
        self._device(ordinal)
        return VMM_GRANULARITY

    def vmm_alloc(self, ordinal: int, size: int) -> int:
        """A zero-filled allocation of device ``ordinal`` (counted against the device; freed with :meth:`vmm_free`,
        or with the current context, which owns it here). No fd: its bytes move into a memfd on its first export."""
        context = self._live_current()
        self._device(ordinal)
        if not self._vmm:
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_SUPPORTED, "this sim has no VMM (made with vmm=False)")
        self._check_vmm_size(size)
        return self._vmm_mapped(self._memory.allocate(ordinal, size, context))

    def vmm_export_fd(self, ptr: int) -> int:
        """A new fd of the sealed memfd that holds the VMM allocation at ``ptr``; the first export moves the bytes
        there (as legacy-stream work, so no queued copy writes to the old bytes), and the memfd stays until the
        allocation is freed. ``CUDA_ERROR_MAP_FAILED`` if the memfd cannot be made (out of fds)."""
        context = self._live_current()
        if not self._is_vmm(ptr):
            raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not the address of a VMM allocation")
        return self._export_memfd(context, self._memory.resolve(ptr, 0)[0])

    def _export_memfd(self, context: SimContext, allocation: Allocation) -> int:
        """A new fd of the memfd holding ``allocation``, made on the first call (:meth:`DeviceMemory.export`)."""
        try:
            self._streams.run_legacy(context, partial(self._memory.export, allocation))
            return os.dup(allocation.storage.fd)
        except (OSError, ValueError) as failure:
            raise CudaError.of(CUresult.CUDA_ERROR_MAP_FAILED, str(failure)) from failure

    def vmm_import_fd(self, ordinal: int, fd: int, size: int) -> int:
        """The memfd ``fd`` (sealed, of exactly ``size`` bytes) mapped as a VMM allocation of device ``ordinal``."""
        context = self._live_current()
        self._device(ordinal)
        self._check_vmm_size(size)
        if not resize_sealed(fd):
            raise CudaError.of(_INVALID_VALUE, "the fd is not sim VMM memory (a sealed memfd)")
        if os.fstat(fd).st_size != size:
            raise CudaError.of(_INVALID_VALUE, f"the memory is {os.fstat(fd).st_size} bytes, not {size}")
        return self._vmm_mapped(self._memory.adopt(ordinal, os.dup(fd), size, context))

    def vmm_free(self, ptr: int) -> None:
        """Unmap and release, as legacy-stream work of the current context (the caller synchronised its work)."""
        context = self._live_current()
        with self._lock:
            if ptr not in self._vmm_ptrs:
                raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not the address of a VMM allocation")
            self._vmm_ptrs.discard(ptr)
        allocation = self._memory.claim(ptr)
        self._streams.run_legacy(context, partial(self._memory.release, allocation))

    def _check_vmm_size(self, size: int) -> None:
        if size <= 0 or size % VMM_GRANULARITY:
            raise CudaError.of(_INVALID_VALUE, f"VMM size {size} is not a positive multiple of {VMM_GRANULARITY}")

    def _vmm_mapped(self, ptr: int) -> int:
        with self._lock:
            self._vmm_ptrs.add(ptr)
        return ptr

    def _is_vmm(self, ptr: int) -> bool:
        with self._lock:
            return ptr in self._vmm_ptrs

    # --- pinned host memory ----------------------------------------------------------------

    def mem_alloc_host(self, size: int) -> memoryview:
        """Page-aligned host memory, freed with the current context; size 0 gives an empty view (NULL)."""
        return self._memory.map_host(size, self._live_current())

    def mem_free_host(self, view: memoryview) -> None:
        """Free by the view :meth:`mem_alloc_host` returned (an empty one is NULL: a no-op).

        Any other buffer, a slice of one or a second free is ``CUDA_ERROR_INVALID_VALUE``.
        """
        self._check_initialized()
        self._memory.unmap_host(view)

    def host_register(self, view: memoryview) -> None:
        """Record the range (nothing to pin here: the sim's copies take any buffer); needs a context."""
        self._live_current()
        with buffer_address(view) as address, self._lock:
            self._registered.add(address, memoryview(view).nbytes)

    def host_unregister(self, view: memoryview) -> None:
        self._live_current()
        with buffer_address(view) as address, self._lock:
            self._registered.remove(address)

    # --- work: a copy or fill, checked when it is issued, run now or on a stream -------------

    def _memset_work(self, ptr: int, value: int, size: int) -> Work:
        if not 0 <= value <= 0xFF:
            raise CudaError.of(_INVALID_VALUE, f"memset value {value} is not a byte")
        allocation, offset = self._memory.resolve(ptr, size)
        return lambda: fill_bytes(_device_bytes(allocation, offset, size), value)

    def _htod_work(self, dst: int, src: Any, size: int) -> Work:
        source = host_view(src, size, writable=False)
        allocation, offset = self._memory.resolve(dst, size)
        return lambda: copy_bytes(_device_bytes(allocation, offset, size), source)

    def _dtoh_work(self, dst: Any, src: int, size: int) -> Work:
        target = host_view(dst, size, writable=True)
        allocation, offset = self._memory.resolve(src, size)
        return lambda: copy_bytes(target, _device_bytes(allocation, offset, size))

    def _dtod_work(self, dst: int, src: int, size: int) -> Work:
        target, dst_offset = self._memory.resolve(dst, size)
        source, src_offset = self._memory.resolve(src, size)
        if target.device != source.device:
            raise CudaError.of(_INVALID_VALUE, "the sim copies device to device only within one device")
        return lambda: copy_bytes(_device_bytes(target, dst_offset, size), _device_bytes(source, src_offset, size))

    # --- internals ---------------------------------------------------------------------

    def _check_initialized(self) -> None:
        if not self._initialized:
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_INITIALIZED)

    def _device(self, ordinal: int) -> SimDevice:
        self._check_initialized()
        if not 0 <= ordinal < len(self._devices):
            raise CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {ordinal}")
        return self._devices[ordinal]

    def _context(self, ctx: Ctx) -> SimContext:
        self._check_initialized()
        if not isinstance(ctx, SimContext):
            raise CudaError.of(_INVALID_CONTEXT, f"{ctx!r} is not a sim context")
        return ctx

    def _pushable(self, ctx: Ctx) -> SimContext:
        context = self._context(ctx)
        if not context.alive and not context.is_primary:
            raise CudaError.of(_INVALID_CONTEXT, "context is destroyed")
        return context

    def _current(self) -> SimContext:
        """The calling thread's current context, live or not."""
        self._check_initialized()
        stack = self._threads.stack
        if not stack:
            raise CudaError.of(_INVALID_CONTEXT, "no context is current on this thread")
        return stack[-1]

    def _live_current(self) -> SimContext:
        context = self._current()
        if not context.alive:
            raise CudaError.of(_CONTEXT_IS_DESTROYED)
        if self._faults:
            self._strike(context.device)
        return context

    def inject_sticky_error(self, ordinal: int, result: CUresult, after_calls: int = 0) -> None:
        """Fault injection for tests: after ``after_calls`` more calls in a live context of the
        device, every such call raises ``result``, as a corrupted CUDA context does."""
        self._device(ordinal)
        self._faults[ordinal] = (after_calls, result)

    def _strike(self, ordinal: int) -> None:
        fault = self._faults.get(ordinal)
        if fault is None:
            return
        left, result = fault
        if left > 0:
            self._faults[ordinal] = (left - 1, result)
            return
        raise CudaError.of(result, f"injected on sim device {ordinal}")

    def _pool(self, pool: Pool) -> SimPool:
        self._check_initialized()
        if not isinstance(pool, SimPool) or not pool.alive:
            raise CudaError.of(_INVALID_VALUE, f"{pool!r} is not a live pool")
        return pool

    def _retire(self, context: SimContext) -> None:
        """After ``context`` died: end its streams and events (their queued work completes
        first), then free its memory. Call holding the lifecycle lock only."""
        self._streams.retire(context)
        with self._lock:
            self._vmm_ptrs.difference_update(context.allocations)
        self._memory.release_owner(context)


def _device_bytes(allocation: Allocation, offset: int, size: int) -> memoryview:
    """When work runs: its bytes, or ``CUDA_ERROR_ILLEGAL_ADDRESS`` if the memory was freed meanwhile."""
    view = allocation.storage.view
    if offset + size > len(view):
        raise CudaError.of(_ILLEGAL_ADDRESS, f"{size} bytes at offset {offset} of freed memory")
    return view[offset : offset + size]
