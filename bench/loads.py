"""Background load on one device, from another client process: the head-of-line figures.

:func:`copy_chain` keeps device A's worker busy with large device-to-device
copies. :func:`sync_chain` issues a burst of copies (through ``Client.pipeline``
where the client has it), then a ``synchronize`` that waits for them, over and
over; ``phase`` (a shared counter) is odd while a ``synchronize`` is in flight,
so the measuring process can tell which of its samples started during one.
Each runs in a spawned process until ``stop`` is set, then reports how long its
own calls took.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from bench.anchors import stop_process
from bench.stats import median

_START_TIMEOUT_S = 120.0
_EMPTY_SYNCS = 50


def _buffers(client: Any, device: int, size: int) -> tuple[Any, Any]:
    src = client.alloc(size, device=device)
    dst = client.alloc(size, device=device)
    src.fill(0x5A)
    return src, dst


def copy_chain(endpoint: str, device: int, size: int, stop: Any, ready: Any, conn: Connection) -> None:
    try:
        from cuctxd.client import Client

        with Client(endpoint, name="bench-load") as client:
            src, dst = _buffers(client, device, size)
            src.copy_to(dst)
            ready.set()
            clock = time.perf_counter_ns
            copies = []
            while not stop.is_set():
                start = clock()
                src.copy_to(dst)
                copies.append(clock() - start)
            client.synchronize(device)
        conn.send(("done", {"copies": len(copies), "copy_ms_p50": median(copies) / 1e6 if copies else None}))
    except Exception:
        ready.set()
        conn.send(("error", traceback.format_exc()))


def sync_chain(endpoint: str, device: int, size: int, copies_per_sync: int, stop: Any, ready: Any,
               phase: Any, conn: Connection) -> None:
    try:
        from cuctxd.client import Client

        with Client(endpoint, name="bench-load") as client:
            src, dst = _buffers(client, device, size)
            clock = time.perf_counter_ns
            empty = []
            for _ in range(_EMPTY_SYNCS):  # a synchronize with nothing queued: its own round trip
                start = clock()
                client.synchronize(device)
                empty.append(clock() - start)
            ready.set()
            issue, waits = [], []
            pipelined = hasattr(client, "pipeline")
            while not stop.is_set():
                start = clock()
                if pipelined:  # queue the whole burst at once, so the GPU has it all before the synchronize
                    with client.pipeline() as pipe:
                        for _ in range(copies_per_sync):
                            pipe.copy(src, dst)
                else:
                    for _ in range(copies_per_sync):
                        src.copy_to(dst)
                issued = clock()
                phase.value += 1  # odd: a synchronize is in flight
                client.synchronize(device)
                phase.value += 1
                issue.append(issued - start)
                waits.append(clock() - issued)
        conn.send(("done", {"syncs": len(waits), "empty_sync_ms_p50": median(empty) / 1e6,
                            "issue_ms_p50": median(issue) / 1e6 if issue else None,
                            "sync_ms_p50": median(waits) / 1e6 if waits else None}))
    except Exception:
        ready.set()
        conn.send(("error", traceback.format_exc()))


class LoadError(RuntimeError):
    """The load process failed; the message carries its traceback."""


class Load:
    """A running load process. ``with Load(...) as load:`` starts it and waits until it is busy;
    leaving the block stops it; :attr:`stats` then holds what it reported."""

    def __init__(self, target: Any, *args: Any, with_phase: bool = False) -> None:
        mp = multiprocessing.get_context("spawn")
        self.stop = mp.Event()
        self.ready = mp.Event()
        self.phase = mp.Value("q", 0, lock=False) if with_phase else None
        self._parent, child = mp.Pipe(duplex=False)
        extra = (self.phase,) if with_phase else ()
        self.process = mp.Process(target=target, args=(*args, self.stop, self.ready, *extra, child),
                                  name="bench-load", daemon=True)
        self._child = child
        self.stats: dict[str, Any] = {}

    def __enter__(self) -> Load:
        self.process.start()
        self._child.close()
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not self.ready.wait(0.2):
                if not self.process.is_alive() or time.monotonic() > deadline:
                    raise LoadError("the load process did not start")
            if self._parent.poll(0):
                self._result()  # it failed while starting
        except BaseException:
            stop_process(self.process)
            self._parent.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        try:
            self._result()
        finally:
            stop_process(self.process)
            self._parent.close()

    def _result(self) -> None:
        if not self._parent.poll(_START_TIMEOUT_S):
            raise LoadError("the load process did not report back")
        kind, value = self._parent.recv()
        if kind == "error":
            raise LoadError(f"the load process failed:\n{value}")
        self.stats = value
