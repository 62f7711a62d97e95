"""Spawned client processes for the throughput figures, kept for the whole run.

Each process waits for a task on its pipe, then: sets up (connects, warms up),
answers ``ready``, waits for ``go``, runs the task's step in a loop for the
given seconds and answers ``(steps, elapsed_ns)``. Starting processes once and
reusing them keeps the spawn cost out of the run time. Multiprocessing uses
``spawn`` only.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from bench.anchors import stop_process
from bench.tasks import TASKS

_READY_TIMEOUT_S = 120.0


class PoolError(RuntimeError):
    """A client process failed; the message carries its traceback."""


def serve(conn: Connection) -> None:
    """The loop of one pool process (runs in the child)."""
    while True:
        message = conn.recv()
        if message is None:
            return
        name, kwargs = message
        task = None
        try:
            task = TASKS[name](**kwargs)
            conn.send(("ready", None))
            seconds = conn.recv()
            clock = time.perf_counter_ns
            step = task.step
            steps = 0
            start = clock()
            deadline = start + int(seconds * 1e9)
            now = start
            while now < deadline:
                step()
                steps += 1
                now = clock()
            conn.send(("done", (steps, now - start)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
        finally:
            if task is not None:
                try:
                    task.close()
                except Exception:
                    conn.send(("error", traceback.format_exc()))


class ClientPool:
    """``size`` spawned client processes; :meth:`close` always ends them."""

    def __init__(self, size: int) -> None:
        mp = multiprocessing.get_context("spawn")
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        try:
            for n in range(size):
                parent, child = mp.Pipe()
                process = mp.Process(target=serve, args=(child,), name=f"bench-client-{n}", daemon=True)
                process.start()
                child.close()
                self._processes.append(process)
                self._conns.append(parent)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._processes)

    def run(self, clients: int, task: str, seconds: float, **kwargs: Any) -> float:
        """``clients`` processes run ``task`` together for ``seconds``; total steps per second.

        Each process counts its own steps over its own measured window (they all
        start on one ``go`` after every one of them is set up); the total rate is
        the sum of the per-process rates.
        """
        if not self._processes:
            raise PoolError("the client pool is closed (an earlier run failed)")
        if clients > self.size:
            raise ValueError(f"the pool has {self.size} processes, asked for {clients}")
        conns = self._conns[:clients]
        for conn in conns:
            conn.send((task, kwargs))
        ready, failures = [], []
        for conn in conns:
            try:
                self._expect(conn, "ready", _READY_TIMEOUT_S)
                ready.append(conn)
            except PoolError as failure:
                failures.append(failure)
        go = 0.0 if failures else seconds  # on a failure, release the others at once
        for conn in ready:
            conn.send(go)
        rate = 0.0
        for conn in ready:
            try:
                steps, elapsed_ns = self._expect(conn, "done", go + _READY_TIMEOUT_S)
                rate += steps / (elapsed_ns / 1e9) if elapsed_ns else 0.0
            except PoolError as failure:
                failures.append(failure)
        if failures:
            raise failures[0]
        return rate

    def _expect(self, conn: Connection, kind: str, timeout: float) -> Any:
        if not conn.poll(timeout):
            self.close()  # a process that hangs leaves the pipes out of step: nothing more can run
            raise PoolError(f"a client process sent nothing within {timeout:.0f} s (waiting for {kind})")
        got, value = conn.recv()
        if got == "error":
            self._drain(conn)
            raise PoolError(f"a client process failed:\n{value}")
        if got != kind:
            raise PoolError(f"a client process answered {got!r}, expected {kind!r}")
        return value

    @staticmethod
    def _drain(conn: Connection) -> None:
        while conn.poll(0.5):
            conn.recv()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # already gone: nothing to tell it
                conn.send(None)
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            stop_process(process)
        for conn in self._conns:
            conn.close()
        self._processes.clear()
        self._conns.clear()
