"""2 MiB pages under a new host buffer's memfd, so that a disk's DMA into it goes in large requests.

A memfd's pages are 4 KiB ones, scattered in physical memory as the allocator hands them out. An
``O_DIRECT`` read into such a buffer reaches the block layer one segment per page: a virtio disk took it
in requests of 512 KiB. Into 2 MiB pages the same read went in requests of the queue's ``max_sectors_kb``
(4 MiB), 8 times fewer, and on those disks the number of requests, not the bytes, set the pace
(``bench/RESULTS.md``, 2026-12-05, fourth session). The memfd's pages are what both mappings, the
client's reads and the driver's DMA see, so they are collapsed once, before the buffer is registered.

Shared memory gets huge pages at fault time only where ``shmem_enabled`` allows it (``never`` by default);
``MADV_COLLAPSE`` (Linux 6.1) collapses populated pages whatever that setting says, except ``deny``, through
a mapping whose addresses are 2 MiB aligned with the file. Where the kernel refuses (older, ``deny``, no 2
MiB of free memory in one piece), the buffer keeps its small pages and works the same.

Which thread may call: the device's host-pages helper thread (:class:`~cuctxd.daemon.device.host.HostBuffers`),
for a memfd nothing maps yet; the worker goes on meanwhile and registers it once this returns.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

#: The huge page size of x86-64 and of arm64 with 4 KiB pages.
HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc() if sys.platform.startswith("linux") else None


def collapse(fd: int, size: int) -> int:
    """Back the memfd ``fd`` (``size`` bytes, new and zero, not mapped by anyone yet) with 2 MiB pages as far
    as whole ones go; returns the bytes now in them (0 where the kernel refused, or below :data:`HUGE_PAGE`).

    ``MADV_COLLAPSE`` refuses a range with no page at all, so one byte of each 2 MiB is written first: the
    kernel fills the rest with zeroes as it collapses, instead of copying pages made only to be copied
    (128 MiB in 7 ms on a 2-CPU VM, against 60 ms with every page made first)."""
    length = size - size % HUGE_PAGE
    if _LIBC is None or length == 0:
        return 0
    try:
        for offset in range(0, length, HUGE_PAGE):
            os.pwrite(fd, b"\0", offset)
    except OSError:
        return 0
    span = length + HUGE_PAGE
    reserved = _LIBC.mmap(None, span, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if reserved in (None, _MAP_FAILED):
        return 0
    try:
        aligned = -(-reserved // HUGE_PAGE) * HUGE_PAGE
        mapped = _LIBC.mmap(aligned, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if mapped != aligned:
            return 0
        return length if _LIBC.madvise(aligned, length, _MADV_COLLAPSE) == 0 else 0
    finally:
        _LIBC.munmap(reserved, span)  # the file keeps its pages; the daemon maps it again to register it
