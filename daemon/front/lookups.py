"""The lookup pool: the threads that run what a front op must wait on outside the daemon.

Today that is ``gpu_limit``'s questions to the API server and the kubelet at a pod's first ``hello``
(:class:`cuctxd.daemon.kubelet.pod_gpus.PodLookup`), each bounded only by its own timeout. The front
thread serves every session, so it never waits on them: a front handler returns
:class:`~cuctxd.daemon.handlers.replies.Deferred`, the front hands its ``look_up`` here and goes on;
a pool thread runs it, queues the outcome and rings :attr:`LookupPool.doorbell` (an eventfd the front
polls beside its sockets); the front then answers, on its own thread, every request that waited on it.
Requests with one ``key`` (one pod's hellos) share one lookup.

Bounded (PROTOCOL.md, "Daemon limits"): ``max_pod_lookups`` threads, so as many lookups at once (more
wait their turn in the queue), and ``max_pending_hellos`` requests waiting on a lookup at once, all keys
together; beyond, the request is refused at once with ``CUCTXD_ERROR_LIMIT_EXCEEDED``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.handlers.replies import Deferred, Reply
from cuctxd.daemon.settings import count
from cuctxd.protos.errors import CuctxError, InternalError, LimitExceeded

log = logging.getLogger(__name__)

#: Lookups run at once (``max_pod_lookups``) and requests waiting on one (``max_pending_hellos``).
DEFAULT_MAX_POD_LOOKUPS = 4
DEFAULT_MAX_PENDING_HELLOS = 256


@dataclass(frozen=True)
class Waiting:
    """A request the front answers once its lookup is done (front thread only)."""

    identity: bytes
    request_id: int
    op: str
    then: Callable[[Any], Reply]
    #: When the front received it (``time.perf_counter``), for its latency.
    started: float


@dataclass(frozen=True)
class Looked:
    """A finished lookup: the requests that waited on it, and its result or its error."""

    waiting: list[Waiting]
    result: Any
    error: CuctxError | None


@dataclass(frozen=True)
class LookupLimits:
    """gpu_limit's lookup pool: lookups at once, hellos waiting on one (:mod:`cuctxd.daemon.settings`)."""

    max_pod_lookups: int = count(DEFAULT_MAX_POD_LOOKUPS, "with gpu_limit: pods' first hellos looked up at once "
                                 "(the API server, the kubelet), each on a thread of its own", low=1, security=True,
                                 limit=True)
    max_pending_hellos: int = count(DEFAULT_MAX_PENDING_HELLOS, "with gpu_limit: hellos waiting on their pod's "
                                    "lookup at once, all pods together", low=1, security=True, limit=True)


class LookupPool:
    """Owned by the front thread (:meth:`submit`, :meth:`finished`); its threads only run lookups and ring."""

    def __init__(self, limits: LookupLimits = LookupLimits()) -> None:
        self.max_waiting = limits.max_pending_hellos
        #: Readable when a lookup has finished; the front polls it.
        self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ring_lock = threading.Lock()
        self._todo: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[str, Any, CuctxError | None]] = queue.SimpleQueue()
        self._waiting: dict[str, list[Waiting]] = {}
        self._count = 0
        self._threads = [threading.Thread(target=self._run, name=f"cuctxd-lookup-{n}", daemon=True)
                         for n in range(limits.max_pod_lookups)]
        for thread in self._threads:
            thread.start()

    def to_status(self) -> dict[str, int]:
        """What ``status`` says of the pool (``pod_lookups``; front thread)."""
        return {"waiting": self._count, "lookups": len(self._waiting), "max_pod_lookups": len(self._threads),
                "max_pending_hellos": self.max_waiting}

    def submit(self, deferred: Deferred, waiting: Waiting) -> None:
        """Answer ``waiting`` once ``deferred``'s key is looked up, starting the lookup unless one with that key
        runs or waits already. Front thread. Raises LimitExceeded at ``max_pending_hellos``."""
        if self._count >= self.max_waiting:
            raise LimitExceeded(f"max_pending_hellos: {self._count} request(s) already wait on a lookup outside "
                                f"the daemon (gpu_limit: the API server, the kubelet); retry shortly")
        waiters = self._waiting.get(deferred.key)
        if waiters is None:
            waiters = self._waiting[deferred.key] = []
            self._todo.put((deferred.key, deferred.look_up))
        waiters.append(waiting)
        self._count += 1

    def finished(self) -> list[Looked]:
        """The lookups done since the last call, each with the requests that waited on it (front thread, when
        the doorbell rang)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.doorbell)
        looked: list[Looked] = []
        while True:
            try:
                key, result, error = self._done.get_nowait()
            except queue.Empty:
                return looked
            waiters = self._waiting.pop(key)
            self._count -= len(waiters)
            looked.append(Looked(waiters, result, error))

    def stop(self) -> None:
        """End the threads once the lookups running now return (within their timeouts; nobody waits for them)
        and close the doorbell now: a lookup that finishes later rings nothing. Main thread, once the front
        has stopped; the requests still waiting stay unanswered, as the daemon is going away."""
        for _ in self._threads:
            self._todo.put(None)
        with self._ring_lock:
            os.close(self.doorbell)
            self.doorbell = -1

    def _run(self) -> None:
        """A pool thread: run each lookup, queue its outcome, ring the front."""
        while (task := self._todo.get()) is not None:
            key, look_up = task
            result, error = None, None
            try:
                result = look_up()
            except CuctxError as exc:
                error = exc
            except Exception:
                log.exception("lookup %s failed", key)
                error = InternalError("unexpected failure in a lookup; see the daemon log")
            self._done.put((key, result, error))
            with self._ring_lock:
                if self.doorbell >= 0:
                    os.eventfd_write(self.doorbell, 1)
