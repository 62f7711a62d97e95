"""Memory of the sim backend: byte storage, the simulated address space, host buffers.

:class:`Storage` is the only place that knows how an allocation's bytes are
held (a ``bytearray`` today; moving to ``multiprocessing.shared_memory`` only
changes that class). :class:`AddressSpace` hands out realistic device
pointers and maps any pointer inside a live allocation back to it.
:func:`host_view` checks the host side of a copy as the cuda backend does.

Nothing here is thread-safe: :class:`daemon.backends.sim.SimDriver` calls it
under its own lock.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from protos.cuda_results import CUresult
from protos.errors import CudaError
from protos.sim_ipc import shm_dir

_INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE

#: Where device 0's addresses start; a Linux UVA address as the real driver gives.
ADDRESS_BASE = 0x7000_0000_0000
#: Address range per device (1 TiB), so pointers of different devices never meet.
DEVICE_SPAN = 1 << 40
#: ``cuMemAlloc`` hands out 512-byte aligned pointers (256 is CUDA's documented minimum).
ALIGNMENT = 512


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) & ~(alignment - 1)


class Storage:
    """The bytes of one allocation, zero-filled; ``view`` is a writable flat memoryview.

    Private memory until :meth:`export` moves the bytes into a shared-memory file
    that other processes can map (the sim's IPC); :meth:`release` removes the file.
    """

    __slots__ = ("_buffer", "path", "view")

    def __init__(self, size: int) -> None:
        self._buffer: bytearray | mmap.mmap = bytearray(size)
        self.view = memoryview(self._buffer)
        self.path: Path | None = None

    def export(self) -> Path:
        """The shared-memory file holding these bytes, created (and filled) on the first call.

        Raises OSError if the file cannot be made. A copy that another thread runs
        meanwhile on the old view is lost, as in any unsynchronised access.
        """
        if self.path is None:
            size = len(self.view)
            fd, name = tempfile.mkstemp(prefix="cuctxd-sim-", dir=shm_dir())
            try:
                os.ftruncate(fd, size)
                shared = mmap.mmap(fd, size)
            except OSError:
                os.unlink(name)
                raise
            finally:
                os.close(fd)
            shared[:] = self.view
            self._buffer, self.view, self.path = shared, memoryview(shared), Path(name)
        return self.path

    def release(self) -> None:
        """Give the bytes back; a copy still running in another thread keeps its own reference."""
        old, self.view = self.view, memoryview(b"")
        buffer, self._buffer = self._buffer, bytearray()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
            try:
                old.release()
                buffer.close()  # type: ignore[union-attr]
            except BufferError:
                pass  # a copy in flight still maps it; the mapping goes with its last reference


class Owner(Protocol):
    """What an allocation's context must offer: the set of its allocations' bases."""

    allocations: set[int]


@dataclass(eq=False)
class Allocation:
    """One live ``cuMemAlloc`` result; ``owner`` is the context it was allocated in."""

    base: int
    size: int
    reserved: int
    device: int
    owner: Owner
    storage: Storage = field(repr=False)

    @property
    def end(self) -> int:
        return self.base + self.size


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

    def remove(self, base: int) -> Allocation | None:
        """Take out the allocation that starts exactly at ``base`` (None if there is none)."""
        allocation = self._by_base.pop(base, None)
        if allocation is not None:
            del self._bases[bisect_left(self._bases, base)]
        return allocation

    def find(self, ptr: int) -> Allocation | None:
        """The live allocation containing address ``ptr``, if any."""
        index = bisect_right(self._bases, ptr) - 1
        if index < 0:
            return None
        allocation = self._by_base[self._bases[index]]
        return allocation if ptr < allocation.end else None

    def __len__(self) -> int:
        return len(self._bases)


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
