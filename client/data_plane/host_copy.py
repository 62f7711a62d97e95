"""Copies between host buffers on several threads: how the data plane feeds DMA faster than one core.

One core copies 5-10 GB/s; the page-locked buffers the daemon copies from move
50 GB/s. Large copies are cut into pieces of at least :data:`PIECE_BYTES`, one per
thread of a process-wide :class:`Gang` (the calling thread takes the first piece
itself), each run with ``ctypes.memmove``, which releases the GIL. Any thread may
call; while one copy holds the gang, another thread's copy runs on its caller alone.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Mapping

from cuctxd.protos.host import buffer_address

#: Smallest piece one thread copies; below twice this, the caller copies alone. On the H200 host a
#: 1 MiB copy took 31 us alone and no less in pieces; 2 MiB 152 us alone, 73 us in two pieces.
PIECE_BYTES = 1 << 20
#: The environment variable that sets :data:`COPY_THREADS` (1: every copy stays on its caller).
COPY_THREADS_ENV = "CUCTXD_COPY_THREADS"
#: The most :data:`COPY_THREADS_ENV` may ask for.
MAX_COPY_THREADS = 64


def copy_threads(environ: Mapping[str, str] = os.environ) -> int:
    """Threads copying at once, the caller included: :data:`COPY_THREADS_ENV` when set, else as many as
    this process may run on, up to 8 (on the H200 host, 16 CPUs, a 16 MiB copy inside a 64 MiB write
    took 0.67 ms on 4 and 0.50 ms on 8). A value that is not a whole number from 1 to
    :data:`MAX_COPY_THREADS` is ignored with a warning."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default = max(1, min(8, cpus))
    text = environ.get(COPY_THREADS_ENV, "").strip()
    if not text:
        return default
    if text.isdigit() and 1 <= int(text) <= MAX_COPY_THREADS:
        return int(text)
    warnings.warn(f"{COPY_THREADS_ENV}={text!r} is not a whole number from 1 to {MAX_COPY_THREADS}; "
                  f"copying on {default} threads", RuntimeWarning, stacklevel=2)
    return default


#: Threads copying at once (the caller included), read once, when this module is imported.
COPY_THREADS = copy_threads()


class Gang:
    """Threads that each copy one piece of a copy, each started and awaited through a lock of its own.

    A thread pool's queue and futures cost more than the copy they carry: on the H200 host a 16 MiB copy
    on 8 threads took 0.75 ms through ``ThreadPoolExecutor`` and 0.50 ms this way. One copy at a time
    (:meth:`run` is refused while one runs); the threads are daemon threads, blocked while idle.
    """

    def __init__(self, threads: int) -> None:
        self._busy = threading.Lock()
        self._work: list[tuple[int, int, int]] = [(0, 0, 0)] * threads
        self._failed: list[BaseException | None] = [None] * threads
        self._go = [threading.Lock() for _ in range(threads)]
        self._done = [threading.Lock() for _ in range(threads)]
        for index in range(1, threads):
            self._go[index].acquire()
            self._done[index].acquire()
            threading.Thread(target=self._serve, args=(index,), name=f"cuctxd-copy-{index}", daemon=True).start()

    @property
    def threads(self) -> int:
        return len(self._go)

    def _serve(self, index: int) -> None:
        """A gang thread: one piece per release of its ``go`` lock."""
        go, done, memmove = self._go[index], self._done[index], ctypes.memmove
        while True:
            go.acquire()
            try:
                memmove(*self._work[index])
            except BaseException as error:  # handed to the caller, never lost with this thread
                self._failed[index] = error
            finally:
                done.release()

    def run(self, spans: list[tuple[int, int, int]]) -> bool:
        """Copy each ``(to, start, size)`` span, the first on the calling thread and the others one per gang
        thread (at most :attr:`threads` spans); False, copying nothing, while another copy holds the gang.
        Returns only once every thread is done with its span, even when interrupted."""
        if not self._busy.acquire(blocking=False):
            return False
        started = 0
        try:
            for index, span in enumerate(spans[1:], 1):
                self._work[index] = span
                started = index  # before the release: an interrupt between the two waits, never races
                self._go[index].release()
            ctypes.memmove(*spans[0])
        finally:
            # a KeyboardInterrupt here leaves the gang busy (later copies run on their callers), never a
            # thread writing into memory its caller has let go
            for index in range(1, started + 1):
                self._done[index].acquire()
            self._busy.release()
        failed = [error for error in self._failed[1:started + 1] if error is not None]
        self._failed[1:started + 1] = [None] * started
        if failed:
            raise failed[0]
        return True


_gang: Gang | None = None
_gang_lock = threading.Lock()


def _the_gang() -> Gang:
    global _gang
    with _gang_lock:
        if _gang is None:
            _gang = Gang(COPY_THREADS)
        return _gang


def _forget_gang() -> None:
    """In a forked child: the gang's threads stayed in the parent."""
    global _gang, _gang_lock
    _gang, _gang_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_gang)


def copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (same length, both contiguous bytes), on several threads when large."""
    size = src.nbytes
    if size != dst.nbytes:
        raise ValueError(f"copy of {size} bytes into {dst.nbytes}")
    pieces = min(COPY_THREADS, size // PIECE_BYTES)
    if pieces >= 2:
        gang = _the_gang()
        pieces = min(pieces, gang.threads)
        with buffer_address(dst) as to, buffer_address(src) as start:
            step = -(-size // pieces)
            if gang.run([(to + at, start + at, min(step, size - at)) for at in range(0, size, step)]):
                return
    dst[:] = src
