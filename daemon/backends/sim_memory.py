"""Memory of the sim backend: byte storage, the simulated address space, pools, host buffers.

:class:`Storage` is the only place that knows how an allocation's bytes are
held (a ``bytearray`` when small, an anonymous ``mmap`` from 1 MiB, a memfd
once exported, a block of its pool's shared memfd for an IPC-capable pool).
:class:`AddressSpace` hands out realistic device pointers and maps any pointer
inside an allocation back to it. :class:`SimPool` is a stream-ordered pool's
cache of freed blocks (and its shared memory,
:class:`~cuctxd.daemon.backends.sim_pools.PoolArena`, when it is IPC-capable).
:func:`host_view` checks the host side of a copy as the cuda backend does; :func:`copy_bytes` and
:func:`fill_bytes` move the bytes, releasing the GIL for anything above
:data:`GIL_FREE_SIZE` so that a big copy on one thread never stalls the others.

:class:`DeviceMemory` puts them together: the tables of every device's
memory behind one lock, which the driver calls from any thread. The other
classes are not thread-safe and are used only under that lock.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Protocol

from cuctxd.daemon.backends.sim_pools import PoolArena
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.host import buffer_address
from cuctxd.protos.memfd import sealed_memfd

_INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
_OUT_OF_MEMORY = CUresult.CUDA_ERROR_OUT_OF_MEMORY

#: Where device 0's addresses start; a Linux UVA address as the real driver gives.
ADDRESS_BASE = 0x7000_0000_0000
#: Address range per device (1 TiB), so pointers of different devices never meet.
DEVICE_SPAN = 1 << 40
#: ``cuMemAlloc`` hands out 512-byte aligned pointers (256 is CUDA's documented minimum).
ALIGNMENT = 512
#: Copies and fills from this size run in C with the GIL released (``ctypes.memmove``/``memset``).
GIL_FREE_SIZE = 64 << 10
#: Allocations from this size are anonymous mappings: zero pages come from the kernel, lazily.
MAPPED_SIZE = 1 << 20


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) & ~(alignment - 1)


class Storage:
    """The bytes of one allocation, zero-filled; ``view`` is a writable flat memoryview.

    Private memory until :meth:`export` moves the bytes into a memfd that other
    processes of the daemon's user can open by its ``/proc`` path (the sim's legacy
    IPC); :meth:`release` closes it. A block of an IPC-capable pool lives in its
    pool's :class:`PoolArena` from the start (:meth:`in_arena`).
    """

    __slots__ = ("_arena", "_buffer", "fd", "offset", "view")

    def __init__(self, size: int) -> None:
        self._buffer: bytearray | mmap.mmap = mmap.mmap(-1, size) if size >= MAPPED_SIZE else bytearray(size)
        self.view = memoryview(self._buffer)
        self.fd = -1
        self._arena: PoolArena | None = None
        self.offset = 0

    @classmethod
    def in_arena(cls, arena: PoolArena, offset: int, size: int) -> Storage:
        """The block ``[offset, offset + size)`` of a pool's shared memory."""
        storage = cls.__new__(cls)
        storage._buffer = bytearray()
        storage.view = arena.view[offset:offset + size]
        storage.fd = -1
        storage._arena = arena
        storage.offset = offset
        return storage

    @classmethod
    def from_memfd(cls, fd: int, size: int) -> Storage:
        """The ``size`` bytes of a memfd (owned from now on): exported memory adopted from another process."""
        storage = cls.__new__(cls)
        storage._buffer = mmap.mmap(fd, size)
        storage.view = memoryview(storage._buffer)
        storage.fd = fd
        storage._arena = None
        storage.offset = 0
        return storage

    def export(self) -> str:
        """The ``/proc/<pid>/fd/<n>`` path of the memfd holding these bytes, made (and filled) on the first call.

        Raises OSError if the memfd cannot be made. A copy that another thread runs
        meanwhile on the old view is lost, as in any unsynchronised access.
        """
        if self.fd < 0:
            size = len(self.view)
            fd = sealed_memfd("cuctxd-sim-export", size)
            try:
                shared = mmap.mmap(fd, size)
            except OSError:
                os.close(fd)
                raise
            view = memoryview(shared)
            copy_bytes(view, self.view)
            old_view, old_buffer = self.view, self._buffer
            self._buffer, self.view, self.fd = shared, view, fd
            _unmap(old_view, old_buffer)
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def release(self) -> None:
        """Give the bytes back; a copy still running in another thread keeps its own reference."""
        old, self.view = self.view, memoryview(b"")
        if self._arena is not None:
            size = old.nbytes
            old.release()
            self._arena.give(self.offset, size)
            self._arena = None
            return
        buffer, self._buffer = self._buffer, bytearray()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unmap(old, buffer)


def _unmap(view: memoryview, buffer: bytearray | mmap.mmap) -> None:
    """Unmap a mapped buffer now unless views of it are still in use (then its last reference does)."""
    if isinstance(buffer, mmap.mmap):
        try:
            view.release()
            buffer.close()
        except BufferError:
            pass  # a copy in flight still maps it; the mapping goes with its last reference


class Owner(Protocol):
    """What an allocation's context must offer: the set of its allocations' bases."""

    allocations: set[int]


@dataclass(eq=False)
class Allocation:
    """One device allocation; ``owner`` is the context it was allocated in, or its pool.

    ``usable`` is False from a free that has not happened yet (``mem_free_async``)
    and while the block sits in its pool's cache: it keeps its address range, but
    every access and free of it is ``CUDA_ERROR_INVALID_VALUE``.
    """

    base: int
    size: int
    reserved: int
    device: int
    owner: Owner
    storage: Storage = field(repr=False)
    pool: SimPool | None = field(default=None, repr=False)
    usable: bool = True

    @property
    def end(self) -> int:
        return self.base + self.size


class SimPool:
    """A simulated ``CUmemoryPool`` of one device: its blocks and the cache of freed ones.

    Freed blocks are kept by reserved size (a multiple of 512) and handed out
    again for the same reserved size, so an alloc+free loop never touches the
    address space; they count as used device memory until :meth:`take_cached_above`
    gives them back (``cuMemPoolTrimTo``, pool destruction, or an allocation that
    would otherwise run out of memory). Compared by identity, like the driver's handles.
    """

    __slots__ = ("_cache", "alive", "allocations", "arena", "cached_bytes", "device", "imported")

    def __init__(self, device: int, arena: PoolArena | None = None, *, imported: bool = False) -> None:
        self.device = device
        #: Imported from another process's fd: it allocates nothing, its blocks are imported pointers.
        self.imported = imported
        #: The pool's shared memory, when it is IPC-capable.
        self.arena = arena
        self.alive = True
        #: Base addresses of every block of the pool, in use, being freed or cached.
        self.allocations: set[int] = set()
        self.cached_bytes = 0
        self._cache: dict[int, list[Allocation]] = {}

    def take(self, reserved: int) -> Allocation | None:
        """A cached block of exactly ``reserved`` bytes, taken out of the cache, or None."""
        blocks = self._cache.get(reserved)
        if not blocks:
            return None
        self.cached_bytes -= reserved
        return blocks.pop()

    def put(self, allocation: Allocation) -> None:
        """Cache a freed block for reuse (it must already be marked not usable)."""
        self._cache.setdefault(allocation.reserved, []).append(allocation)
        self.cached_bytes += allocation.reserved

    def take_cached_above(self, keep: int) -> list[Allocation]:
        """Take cached blocks out, largest first, until at most ``keep`` bytes stay cached."""
        taken: list[Allocation] = []
        for reserved in sorted(self._cache, reverse=True):
            blocks = self._cache[reserved]
            while blocks and self.cached_bytes > keep:
                taken.append(blocks.pop())
                self.cached_bytes -= reserved
            if not blocks:
                del self._cache[reserved]
        return taken

    def __repr__(self) -> str:
        state = "" if self.alive else ", destroyed"
        return f"<SimPool device {self.device}, {len(self.allocations)} blocks, {self.cached_bytes} cached{state}>"


class AddressSpace:
    """Live allocations of all devices, sorted by base address for bisection.

    Each device owns ``[start, start + span)``. Placement is next-fit: a per-device
    cursor moves forward past live allocations and wraps to the start of the range
    once it runs off the end, so a freed address is reused only after the whole
    range has been walked, and a live one never.
    """

    def __init__(self, device_count: int, span: int = DEVICE_SPAN, base: int = ADDRESS_BASE) -> None:
        self.span = span
        self._starts = [base + ordinal * span for ordinal in range(device_count)]
        self._cursors = list(self._starts)
        self._bases: list[int] = []
        self._by_base: dict[int, Allocation] = {}

    def device_range(self, ordinal: int) -> tuple[int, int]:
        start = self._starts[ordinal]
        return start, start + self.span

    def place(self, ordinal: int, size: int) -> int | None:
        """A free, aligned base for ``size`` bytes on the device, or None if none fits."""
        low, high = self.device_range(ordinal)
        cursor = self._cursors[ordinal]
        wrapped = False
        while True:
            start = align_up(cursor)
            end = start + size
            if end > high:
                if wrapped:
                    return None
                wrapped, cursor = True, low
                continue
            index = bisect_left(self._bases, start)
            if index > 0:
                before = self._by_base[self._bases[index - 1]]
                if before.end > start:
                    cursor = before.end
                    continue
            if index < len(self._bases) and self._bases[index] < end:
                cursor = self._by_base[self._bases[index]].end
                continue
            self._cursors[ordinal] = end
            return start

    def insert(self, allocation: Allocation) -> None:
        index = bisect_left(self._bases, allocation.base)
        self._bases.insert(index, allocation.base)
        self._by_base[allocation.base] = allocation

    def get(self, base: int) -> Allocation | None:
        """The allocation that starts exactly at ``base`` (None if there is none)."""
        return self._by_base.get(base)

    def remove(self, base: int) -> Allocation | None:
        """Take out the allocation that starts exactly at ``base`` (None if there is none)."""
        allocation = self._by_base.pop(base, None)
        if allocation is not None:
            del self._bases[bisect_left(self._bases, base)]
        return allocation

    def find(self, ptr: int) -> Allocation | None:
        """The allocation containing address ``ptr``, if any (usable or not)."""
        index = bisect_right(self._bases, ptr) - 1
        if index < 0:
            return None
        allocation = self._by_base[self._bases[index]]
        return allocation if ptr < allocation.end else None

    def __len__(self) -> int:
        return len(self._bases)


class LiveOwner(Owner, Protocol):
    """A context as :meth:`DeviceMemory.allocate` sees it: its allocations and whether it is alive."""

    alive: bool


class DeviceMemory:
    """The memory of every simulated device: allocations, pool blocks, accounting, pinned host memory.

    Thread safety: any thread may call it; one lock guards the tables and is
    never held while bytes are copied, except while the first export of an
    allocation moves its bytes into the shared file. Errors are CUDA's:
    ``CUDA_ERROR_INVALID_VALUE`` for a pointer outside every usable allocation,
    ``CUDA_ERROR_OUT_OF_MEMORY`` past a device's capacity.
    """

    def __init__(self, capacity: int, device_count: int) -> None:
        self.capacity = capacity
        self._used = [0] * device_count
        self._space = AddressSpace(device_count)
        self._host: dict[int, HostAllocation] = {}
        self._lock = threading.Lock()

    def info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of a device; blocks cached in pools count as used."""
        return self.capacity - self._used[device], self.capacity

    # --- allocations -------------------------------------------------------------------

    def allocate(self, device: int, size: int, owner: LiveOwner) -> int:
        """A zero-filled allocation of a context; ``CONTEXT_IS_DESTROYED`` if it died meanwhile."""
        if size <= 0:
            raise CudaError.of(_INVALID_VALUE, f"allocation size {size}")
        reserved = align_up(size)
        if reserved > self.capacity - self._used[device]:
            raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes requested")
        storage = _new_storage(size)
        with self._lock:
            if not owner.alive:
                raise CudaError.of(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)
            return self._insert(device, size, reserved, owner, storage, None)

    def resolve(self, ptr: int, size: int) -> tuple[Allocation, int]:
        """The usable allocation holding ``[ptr, ptr + size)`` and the offset in it."""
        if size < 0:
            raise CudaError.of(_INVALID_VALUE, f"size {size}")
        with self._lock:
            allocation = self._space.find(ptr)
        if allocation is None or not allocation.usable:
            raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not in a live allocation")
        offset = ptr - allocation.base
        if offset + size > allocation.size:
            raise CudaError.of(
                _INVALID_VALUE,
                f"{size} bytes at {ptr:#x} run past the end of the {allocation.size}-byte allocation",
            )
        return allocation, offset

    def claim(self, ptr: int) -> Allocation:
        """Start freeing the allocation at ``ptr``: from now on it is refused; :meth:`release` ends it."""
        with self._lock:
            allocation = self._space.get(ptr)
            if allocation is None or not allocation.usable:
                raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not the start of a live allocation")
            allocation.usable = False
        return allocation

    def release(self, allocation: Allocation) -> None:
        """Complete a free: back to a live pool's cache, else to the device (any thread).

        A block that went with its context or pool meanwhile is left alone.
        """
        with self._lock:
            if self._space.get(allocation.base) is not allocation:
                return
            pool = allocation.pool
            if pool is not None and pool.alive:
                pool.put(allocation)
                return
            storages = self._drop([allocation])
        _release_all(storages)

    def release_owner(self, owner: Owner) -> None:
        """Free everything of a destroyed context: its allocations and its pinned host memory."""
        with self._lock:
            allocations = [self._space.get(base) for base in owner.allocations]
            storages = self._drop([allocation for allocation in allocations if allocation is not None])
            hosts = [self._host.pop(address) for address, host in list(self._host.items()) if host.owner is owner]
        _release_all(storages)
        for host in hosts:
            host.release()

    def export(self, allocation: Allocation) -> str:
        """Move an allocation's bytes to a memfd (see :meth:`Storage.export`)."""
        with self._lock:
            return allocation.storage.export()

    # --- pools -------------------------------------------------------------------------

    def pool_allocate(self, pool: SimPool, size: int) -> int:
        """A cached block of the same reserved size, else a new block.

        When the device is full the pool first gives back its other cached blocks.
        """
        if size <= 0:
            raise CudaError.of(_INVALID_VALUE, f"allocation size {size}")
        reserved = align_up(size)
        with self._lock:
            block = pool.take(reserved)
            if block is not None:
                block.size, block.usable = size, True
                return block.base
        device = pool.device
        if reserved > self.capacity - self._used[device] + pool.cached_bytes:
            raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes requested from a pool of device {device}")
        storage = _new_storage(reserved) if pool.arena is None else None
        trimmed: list[Storage] = []
        try:
            with self._lock:
                if not pool.alive:
                    raise CudaError.of(_INVALID_VALUE, "the pool was destroyed")
                if reserved > self.capacity - self._used[device]:
                    trimmed = self._drop(pool.take_cached_above(0))
                if storage is None:
                    storage = self._arena_block(pool, reserved)
                return self._insert(device, size, reserved, pool, storage, pool)
        finally:
            _release_all(trimmed)

    def _arena_block(self, pool: SimPool, reserved: int) -> Storage:
        arena = pool.arena
        assert arena is not None
        offset = arena.take(reserved)
        if offset is None:
            raise CudaError.of(_OUT_OF_MEMORY, f"{reserved} bytes: the pool's shared memory is fragmented")
        return Storage.in_arena(arena, offset, reserved)

    def pool_import(self, pool: SimPool, offset: int, size: int) -> int:
        """The block ``[offset, offset + size)`` of an imported pool's shared memory as an allocation of it,
        counted against its device; ``INVALID_VALUE`` where that is not a free, whole block of it."""
        arena = pool.arena
        reserved = align_up(size)
        if arena is None or size <= 0 or offset % ALIGNMENT or offset + reserved > arena.span \
                or not arena.claim(offset, reserved):
            raise CudaError.of(_INVALID_VALUE, f"{size} bytes at offset {offset} are no block of the imported pool")
        try:
            with self._lock:
                if not pool.alive:
                    raise CudaError.of(_INVALID_VALUE, "the pool was destroyed")
                return self._insert(pool.device, size, reserved, pool, Storage.in_arena(arena, offset, reserved), pool)
        except BaseException:
            arena.give(offset, reserved)
            raise

    def adopt(self, device: int, fd: int, size: int, owner: LiveOwner) -> int:
        """A memfd of ``size`` bytes (owned from now on) as an allocation of ``owner``, counted against ``device``."""
        try:
            storage = Storage.from_memfd(fd, size)
        except (OSError, ValueError) as failure:
            os.close(fd)
            raise CudaError.of(_INVALID_VALUE, f"cannot map the memory: {failure}") from None
        try:
            with self._lock:
                if not owner.alive:
                    raise CudaError.of(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)
                return self._insert(device, size, align_up(size), owner, storage, None)
        except BaseException:
            storage.release()
            raise

    def export_pointer(self, ptr: int) -> tuple[int, int]:
        """(offset in its pool's shared memory, size) of a usable block of an IPC-capable pool at ``ptr``."""
        with self._lock:
            allocation = self._space.get(ptr)
            if allocation is None or not allocation.usable or allocation.pool is None or allocation.pool.arena is None:
                raise CudaError.of(_INVALID_VALUE, f"{ptr:#x} is not the start of a live block of an IPC-capable pool")
            return allocation.storage.offset, allocation.size

    def pool_trim(self, pool: SimPool, keep: int) -> None:
        """Give cached blocks back to the device until at most ``keep`` bytes stay cached."""
        with self._lock:
            storages = self._drop(pool.take_cached_above(keep))
        _release_all(storages)

    # --- pinned host memory -------------------------------------------------------------

    def map_host(self, size: int, owner: object) -> memoryview:
        """Pinned memory of ``owner``; size 0 is an empty view, as cuMemAllocHost(0) gives NULL."""
        if size == 0:
            return memoryview(bytearray())
        if size < 0:
            raise CudaError.of(_INVALID_VALUE, f"host allocation size {size}")
        try:
            host = HostAllocation.map(size, owner)
        except (OSError, MemoryError, OverflowError) as failure:
            raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes of host memory: {failure}") from None
        with self._lock:
            self._host[host.address] = host
        return host.view

    def unmap_host(self, view: object) -> None:
        """Free by (the start of) a view that :meth:`map_host` returned; else ``INVALID_VALUE``.

        An empty view is NULL, which cuMemFreeHost accepts.
        """
        try:
            if memoryview(view).nbytes == 0:  # type: ignore[arg-type]
                return
            with buffer_address(view) as address:
                pass
        except (TypeError, ValueError, BufferError):  # not a buffer, or a view already released
            raise CudaError.of(_INVALID_VALUE, "not a buffer from mem_alloc_host") from None
        with self._lock:
            host = self._host.pop(address, None)
        if host is None:
            raise CudaError.of(_INVALID_VALUE, "not the start of a buffer from mem_alloc_host")
        host.release()

    # --- internals, under the lock ----------------------------------------------------------

    def _insert(
        self, device: int, size: int, reserved: int, owner: Owner, storage: Storage, pool: SimPool | None
    ) -> int:
        if reserved > self.capacity - self._used[device]:
            raise CudaError.of(_OUT_OF_MEMORY, f"{size} bytes requested")
        base = self._space.place(device, reserved)
        if base is None:
            raise CudaError.of(_OUT_OF_MEMORY, "address range of the device is fragmented")
        self._space.insert(Allocation(base, size, reserved, device, owner, storage, pool))
        owner.allocations.add(base)
        self._used[device] += reserved
        return base

    def _drop(self, allocations: list[Allocation]) -> list[Storage]:
        """Take allocations out of the tables and their devices' use; their storages to release."""
        for allocation in allocations:
            self._space.remove(allocation.base)
            allocation.owner.allocations.discard(allocation.base)
            self._used[allocation.device] -= allocation.reserved
        return [allocation.storage for allocation in allocations]


def _new_storage(size: int) -> Storage:
    try:
        return Storage(size)
    except (MemoryError, OSError):
        raise CudaError.of(_OUT_OF_MEMORY, f"host memory for {size} bytes") from None


def _release_all(storages: list[Storage]) -> None:
    for storage in storages:
        storage.release()


def host_view(buffer: object, size: int, *, writable: bool) -> memoryview:
    """The first ``size`` bytes of a host buffer as a flat byte view."""
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)  # type: ignore[arg-type]
    if writable and view.readonly:
        raise CudaError.of(_INVALID_VALUE, "the host destination buffer is read-only")
    if not view.c_contiguous:
        raise CudaError.of(_INVALID_VALUE, "the host buffer is not contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if size < 0 or view.nbytes < size:
        raise CudaError.of(_INVALID_VALUE, f"the host buffer has {view.nbytes} bytes, {size} needed")
    return view[:size]


# --- moving bytes -------------------------------------------------------------------------


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into the same-sized ``dst`` (overlap behaves like memmove).

    From :data:`GIL_FREE_SIZE` on, the bytes move in ``ctypes.memmove`` with the
    GIL released; below, a slice assignment is cheaper than taking the addresses.
    """
    size = len(dst)
    if size < GIL_FREE_SIZE:
        dst[:] = src
        return
    with buffer_address(dst) as target, buffer_address(src) as source:
        ctypes.memmove(target, source, size)


def fill_bytes(dst: memoryview, value: int) -> None:
    """Set every byte of ``dst`` to ``value``; with the GIL released from :data:`GIL_FREE_SIZE` on."""
    size = len(dst)
    if size < GIL_FREE_SIZE:
        dst[:] = bytes((value,)) * size
        return
    with buffer_address(dst) as target:
        ctypes.memset(target, value, size)


@dataclass(eq=False)
class HostAllocation:
    """Page-locked host memory of ``cuMemAllocHost``: an anonymous, page-aligned mapping.

    ``owner`` is the context it was allocated in; destroying that context frees it, as in CUDA.
    """

    address: int
    mapping: mmap.mmap = field(repr=False)
    view: memoryview = field(repr=False)
    owner: object = field(repr=False)

    @classmethod
    def map(cls, size: int, owner: object) -> HostAllocation:
        """Map ``size`` zeroed bytes; raises OSError (or MemoryError) when the host has none."""
        mapping = mmap.mmap(-1, size)
        view = memoryview(mapping)
        with buffer_address(view) as address:
            return cls(address, mapping, view, owner)

    def release(self) -> None:
        """Unmap now, or once the caller's last view of it is gone."""
        _unmap(self.view, self.mapping)
