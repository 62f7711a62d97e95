"""The sim's IPC-capable pool memory and its registered host memory.

:class:`PoolArena` is the shared memory behind one IPC-capable sim pool: a
single memfd, sparse, mapped once and cut into blocks (first fit). Its fd is what
``mem_pool_export_fd`` hands out, so another process imports the whole pool with
one ``mmap`` and then finds each block by its offset, as a CUDA process imports a
pool once and then each pointer. Nothing is ever a file: the memory goes with the
last process that maps it (an arena has its own lock: blocks come back from any
thread). :class:`HostRegistrations` is what ``cuMemHostRegister`` records; the
sim driver calls it under its lock.
"""

from __future__ import annotations

import mmap
import os
import threading
from bisect import bisect_left, insort

from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.memfd import sealed_memfd

_PAGE = mmap.PAGESIZE


class PoolArena:
    """One pool's memfd of ``span`` bytes (sparse: only written pages cost memory), mapped here; sealed against
    resizing (:mod:`cuctxd.protos.memfd`), so an importer cannot cut off pages this process touches."""

    def __init__(self, span: int, fd: int = -1) -> None:
        """A new memfd of ``span`` bytes, or (``fd`` given, owned from now on) an existing one: an imported pool's."""
        self.fd = sealed_memfd("cuctxd-sim-pool", span) if fd < 0 else fd
        try:
            self._map = mmap.mmap(self.fd, span)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self.span = span
        #: Free extents as (offset, size), sorted by offset, never adjacent.
        self._free: list[tuple[int, int]] = [(0, span)]
        self.blocks = 0
        self.closing = False
        self._lock = threading.Lock()

    def take(self, size: int) -> int | None:
        """The offset of ``size`` free bytes (first fit), or None when no extent is large enough."""
        with self._lock:
            return self._take(size)

    def _take(self, size: int) -> int | None:
        for index, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, length - size)
                self.blocks += 1
                return offset
        return None

    def claim(self, offset: int, size: int) -> bool:
        """Take the block ``[offset, offset + size)`` if it is free (an imported pointer's); False otherwise."""
        with self._lock:
            for index, (start, length) in enumerate(self._free):
                if start <= offset and offset + size <= start + length:
                    pieces = [(start, offset - start), (offset + size, start + length - offset - size)]
                    self._free[index:index + 1] = [piece for piece in pieces if piece[1]]
                    self.blocks += 1
                    return True
        return False

    def give(self, offset: int, size: int) -> None:
        """Return a block: its whole pages are punched out of the memfd (memory given back, zeros after)."""
        with self._lock:
            self._give(offset, size)

    def _give(self, offset: int, size: int) -> None:
        start, end = -(-offset // _PAGE) * _PAGE, (offset + size) // _PAGE * _PAGE
        if end > start:
            self._map.madvise(mmap.MADV_REMOVE, start, end - start)
        insort(self._free, (offset, size))
        index = bisect_left(self._free, (offset, size))
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
            self._free[index] = (offset, size + self._free[index + 1][1])
            del self._free[index + 1]
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:
            previous = self._free[index - 1]
            self._free[index - 1] = (previous[0], previous[1] + self._free[index][1])
            del self._free[index]
        self.blocks -= 1
        if self.closing and not self.blocks:
            self._close()

    def export_fd(self) -> int:
        """A new fd of the memfd, owned by the caller."""
        return os.dup(self.fd)

    def close(self) -> None:
        """The pool is destroyed: unmap and close once its last block is given back."""
        with self._lock:
            self.closing = True
            if not self.blocks:
                self._close()

    def _close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass  # a copy in flight still maps it; the mapping goes with its last reference
        os.close(self.fd)
        self.fd = -1


class HostRegistrations:
    """Host ranges registered with ``host_register``, as (start, end) by start."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}

    def add(self, start: int, size: int) -> None:
        index = bisect_left(self._starts, start)
        overlaps_before = index > 0 and self._ends[self._starts[index - 1]] > start
        overlaps_after = index < len(self._starts) and self._starts[index] < start + size
        if overlaps_before or overlaps_after:
            raise CudaError.of(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                               f"{size} bytes at {start:#x} overlap registered host memory")
        self._starts.insert(index, start)
        self._ends[start] = start + size

    def remove(self, start: int) -> None:
        if self._ends.pop(start, None) is None:
            raise CudaError.of(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                               f"{start:#x} is not the start of registered host memory")
        del self._starts[bisect_left(self._starts, start)]
