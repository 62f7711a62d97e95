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
  allocation: the path of the shared-memory file its bytes then live in.

All operations are synchronous, so ``ctx_synchronize`` only checks the context.
Thread safety: any thread may call any method; one lock guards the shared tables
and is never held while bytes are copied.
"""

from __future__ import annotations

import itertools
import threading
import uuid

from daemon.backends.base import Ctx, Driver
from daemon.backends.sim_memory import (
    DEVICE_SPAN,
    AddressSpace,
    Allocation,
    Storage,
    align_up,
    host_view,
)
from protos.cuda_results import CUresult
from protos.errors import CudaError
from protos.records import DeviceInfo
from protos.sim_ipc import encode_handle

#: What ``cuCtxGetApiVersion`` reports on current drivers.
API_VERSION = 3020
#: ``CU_CTX_MAP_HOST``: the real driver reports it in an active primary context's flags.
CU_CTX_MAP_HOST = 0x08
#: All ``CUctx_flags`` bits; ``(flags & 0x07)`` must be one of the scheduling values.
_CTX_FLAGS_MASK = 0xFF
_SCHED_VALUES = (0x00, 0x01, 0x02, 0x04)
MAX_DEVICES = 16
_MEMSET_CHUNK = 1 << 24

_INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
_INVALID_CONTEXT = CUresult.CUDA_ERROR_INVALID_CONTEXT
_CONTEXT_IS_DESTROYED = CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED
_OUT_OF_MEMORY = CUresult.CUDA_ERROR_OUT_OF_MEMORY


class SimContext:
    """A simulated ``CUcontext``: the opaque :data:`Ctx` the sim backend hands out.

    Compared by identity, like the driver's handles. ``allocations`` holds the base
    addresses of the memory allocated in it, freed when it is destroyed.
    """

    __slots__ = ("alive", "allocations", "context_id", "device", "flags", "is_primary")

    def __init__(self, device: int, flags: int, is_primary: bool, context_id: int, alive: bool) -> None:
        self.device = device
        self.flags = flags
        self.is_primary = is_primary
        self.context_id = context_id
        self.alive = alive
        self.allocations: set[int] = set()

    def __repr__(self) -> str:
        kind = "primary" if self.is_primary else "created"
        state = "" if self.alive else ", destroyed"
        return f"<SimContext {self.context_id} device {self.device}, {kind}{state}>"


class _Device:
    """One simulated GPU: its description, memory accounting and primary context."""

    __slots__ = ("capacity", "info", "primary", "primary_refcount", "used")

    def __init__(self, ordinal: int, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.primary = SimContext(ordinal, 0, is_primary=True, context_id=0, alive=False)
        self.primary_refcount = 0
        name = uuid.uuid5(uuid.NAMESPACE_URL, f"cuctxd-sim://device/{ordinal}")
        self.info = DeviceInfo(
            index=ordinal,
            name="cuctxd simulated GPU",
            uuid=f"GPU-{name}",
            pci_bus_id=f"0000:{ordinal + 1:02x}:00.0",
            compute_capability=(9, 0),
            total_memory=capacity,
            multiprocessor_count=132,
        )


class _ThreadStacks(threading.local):
    """The calling host thread's context stack; the top is the current context."""

    def __init__(self) -> None:
        self.stack: list[SimContext] = []


class SimDriver(Driver):
    """A faithful in-process CUDA driver; see the module docstring for its rules.

    ``device_count`` (0 to 16; 0 makes :meth:`init` raise ``CUDA_ERROR_NO_DEVICE``)
    devices of ``memory_per_device`` bytes each.
    """

    name = "sim"

    def __init__(self, device_count: int = 2, memory_per_device: int = 1 << 30) -> None:
        if not 0 <= device_count <= MAX_DEVICES:
            raise ValueError(f"device_count must be 0..{MAX_DEVICES}, got {device_count}")
        if not 0 < memory_per_device <= DEVICE_SPAN // 4:
            limit = DEVICE_SPAN // 4
            raise ValueError(f"memory_per_device must be 1..{limit} bytes, got {memory_per_device}")
        self._devices = [_Device(ordinal, memory_per_device) for ordinal in range(device_count)]
        self._space = AddressSpace(device_count)
        self._lock = threading.Lock()
        self._threads = _ThreadStacks()
        self._context_ids = itertools.count(1)
        self._initialized = False

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
        with self._lock:
            primary = device.primary
            if device.primary_refcount == 0:
                primary.context_id = next(self._context_ids)
                primary.flags = CU_CTX_MAP_HOST
                primary.alive = True
            device.primary_refcount += 1
        return Ctx(primary)

    def primary_ctx_release(self, ordinal: int) -> None:
        """The last release frees the primary context's memory and deactivates it.

        It is not popped from any stack; ``CUDA_ERROR_INVALID_CONTEXT`` if not retained.
        """
        device = self._device(ordinal)
        with self._lock:
            if device.primary_refcount == 0:
                raise CudaError.of(_INVALID_CONTEXT, f"primary context of device {ordinal} is not retained")
            device.primary_refcount -= 1
            if device.primary_refcount > 0:
                return
            primary = device.primary
            primary.alive = False
            primary.flags = 0
            storages = self._free_all(primary)
        for storage in storages:
            storage.release()

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
        """Destroy a created context and free its memory; pop it if it is the caller's current one.

        Other threads keep it on their stacks (their calls then raise
        ``CUDA_ERROR_CONTEXT_IS_DESTROYED``). ``CUDA_ERROR_INVALID_CONTEXT`` for a
        primary context (release it instead) or one already destroyed.
        """
        context = self._context(ctx)
        if context.is_primary:
            raise CudaError.of(_INVALID_CONTEXT, "a primary context is released, not destroyed")
        with self._lock:
            if not context.alive:
                raise CudaError.of(_INVALID_CONTEXT, "context is already destroyed")
            context.alive = False
            storages = self._free_all(context)
        stack = self._threads.stack
        if stack and stack[-1] is context:
            stack.pop()
        for storage in storages:
            storage.release()

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
        self._live_current()

    # --- memory, in the current context ------------------------------------------------

    def mem_alloc(self, size: int) -> int:
        """A zero-filled allocation in the current context; 512-byte aligned, accounted in 512s."""
        context = self._live_current()
        if size <= 0:
            raise CudaError.of(_INVALID_VALUE, f"allocation size {size}")
        device = self._devices[context.device]
        reserved = align_up(size)
        if reserved > device.capacity - device.used:
            raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes requested")
        try:
            storage = Storage(size)
        except MemoryError:
            raise CudaError.of(_OUT_OF_MEMORY, f"host memory for {size} bytes") from None
        with self._lock:
            if not context.alive:
                raise CudaError.of(_CONTEXT_IS_DESTROYED)
            if reserved > device.capacity - device.used:
                raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes requested")
            base = self._space.place(context.device, reserved)
            if base is None:
                raise CudaError.of(_OUT_OF_MEMORY, "address range of the device is fragmented")
            self._space.insert(Allocation(base, size, reserved, context.device, context, storage))
            context.allocations.add(base)
            device.used += reserved
        return base

    def mem_free(self, ptr: int) -> None:
        """Free an allocation by its base pointer, from any live context; 0 is a no-op."""
        self._live_current()
        if ptr == 0:
            return
        with self._lock:
            allocation = self._space.remove(ptr)
            if allocation is None:
                raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not the start of a live allocation")
            allocation.owner.allocations.discard(ptr)
            self._devices[allocation.device].used -= allocation.reserved
        allocation.storage.release()

    def mem_get_info(self) -> tuple[int, int]:
        device = self._devices[self._live_current().device]
        return device.capacity - device.used, device.capacity

    def memset_d8(self, ptr: int, value: int, size: int) -> None:
        self._live_current()
        if not 0 <= value <= 0xFF:
            raise CudaError.of(_INVALID_VALUE, f"memset value {value} is not a byte")
        with self._lock:
            allocation, offset = self._resolve(ptr, size)
            view = allocation.storage.view
        end = offset + size
        chunk = bytes((value,)) * min(size, _MEMSET_CHUNK)
        while offset < end:
            step = min(end - offset, len(chunk))
            view[offset : offset + step] = chunk[:step]
            offset += step

    def memcpy_htod(self, dst: int, src: memoryview | bytes | bytearray, size: int) -> None:
        """Copy from any buffer-protocol object (a non-buffer raises ``TypeError``)."""
        self._live_current()
        source = host_view(src, size, writable=False)
        with self._lock:
            allocation, offset = self._resolve(dst, size)
            view = allocation.storage.view
        view[offset : offset + size] = source

    def memcpy_dtoh(self, dst: memoryview | bytearray, src: int, size: int) -> None:
        """Copy into a writable buffer; a read-only one is ``CUDA_ERROR_INVALID_VALUE``."""
        self._live_current()
        target = host_view(dst, size, writable=True)
        with self._lock:
            allocation, offset = self._resolve(src, size)
            view = allocation.storage.view
        target[:] = view[offset : offset + size]

    def memcpy_dtod(self, dst: int, src: int, size: int) -> None:
        """Copy within one device (overlap behaves like memmove); across devices ``INVALID_VALUE``."""
        self._live_current()
        with self._lock:
            target, dst_offset = self._resolve(dst, size)
            source, src_offset = self._resolve(src, size)
            dst_view, src_view = target.storage.view, source.storage.view
        if target.device != source.device:
            raise CudaError.of(_INVALID_VALUE, "the sim copies device to device only within one device")
        dst_view[dst_offset : dst_offset + size] = src_view[src_offset : src_offset + size]

    # --- sharing ----------------------------------------------------------------------

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        """The same 64 bytes for any pointer into one live allocation: its shared-memory file.

        The first call moves the allocation's bytes into a file in ``/dev/shm``
        (:mod:`protos.sim_ipc` encodes its path); freeing the allocation removes it.
        Needs a live current context; a pointer outside every live allocation is
        ``CUDA_ERROR_INVALID_VALUE``, as on the real driver; ``CUDA_ERROR_MAP_FAILED``
        if the file cannot be made.
        """
        self._live_current()
        with self._lock:
            allocation, _ = self._resolve(ptr, 0)
            try:
                path = allocation.storage.export()
                return encode_handle(path)
            except (OSError, ValueError) as failure:
                raise CudaError.of(CUresult.CUDA_ERROR_MAP_FAILED, str(failure)) from failure

    # --- internals ---------------------------------------------------------------------

    def _check_initialized(self) -> None:
        if not self._initialized:
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_INITIALIZED)

    def _device(self, ordinal: int) -> _Device:
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
        return context

    def _resolve(self, ptr: int, size: int) -> tuple[Allocation, int]:
        """The allocation holding ``[ptr, ptr + size)`` and the offset in it; call under the lock."""
        if size < 0:
            raise CudaError.of(_INVALID_VALUE, f"size {size}")
        allocation = self._space.find(ptr)
        if allocation is None:
            raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not in a live allocation")
        offset = ptr - allocation.base
        if offset + size > allocation.size:
            raise CudaError.of(
                _INVALID_VALUE,
                f"{size} bytes at {ptr:#x} run past the end of the {allocation.size}-byte allocation",
            )
        return allocation, offset

    def _free_all(self, context: SimContext) -> list[Storage]:
        """Drop every allocation of ``context`` from the tables; call under the lock."""
        storages = []
        for base in context.allocations:
            allocation = self._space.remove(base)
            if allocation is not None:
                self._devices[allocation.device].used -= allocation.reserved
                storages.append(allocation.storage)
        context.allocations.clear()
        return storages
