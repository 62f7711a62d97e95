"""Streams and events of the sim backend: FIFO queues on executor threads, ordered as CUDA orders them.

:class:`StreamScheduler` knows nothing about memory: the driver hands it work
(a callable that moves bytes, or nothing for an event record) and it decides
when that work may run. The rules mirror CUDA's:

* Every :class:`SimStream` runs its work in order on its own daemon thread,
  started by its first work item. ``stream_destroy`` queues a stop behind the
  work already there, so the thread drains the queue and ends; the call returns
  at once.
* Each context has a legacy default stream (``None`` in the driver interface).
  Work on it waits for all earlier work on every *blocking* stream of the
  context, and later work on a blocking stream waits for it; ``non_blocking``
  streams are exempt. The synchronous memory calls are legacy-stream work run
  on the calling thread (:meth:`StreamScheduler.run_legacy`).
* Dependencies are :class:`Marker` objects: each work item completes one when
  it is done and waits for the markers it was given. A marker only ever names
  work queued before it, so waits cannot form a cycle.
* An event record is an empty work item on a stream; the event holds the marker
  of its latest record. ``stream_wait_event`` queues an empty item that waits for
  the marker the event had at that moment (nothing, if it was never recorded).
* Work that fails stores its error on its stream; the first one is raised, and
  cleared, by the next ``stream_query``/``stream_synchronize`` of that stream or
  ``ctx_synchronize`` of its context (CUDA reports asynchronous errors at the
  next synchronisation point too). Later work still runs.

Streams and events are handles of the context that was current when they were
made; any thread may use them with any context current (CUDA allows that for
copies, queries and waits), except that an event can only be recorded on a
stream of its own context (``CUDA_ERROR_INVALID_HANDLE``, as cuEventRecord
gives). Queries and synchronisation need no current context, as in CUDA.

A destroyed stream or event, or one of a destroyed context, is refused with
``CUDA_ERROR_INVALID_HANDLE``, except that ``event_query`` and
``event_synchronize`` of a destroyed event raise ``CUDA_ERROR_CONTEXT_IS_DESTROYED``,
which is what the real driver answered there (H200, driver 580). Everywhere else
the real driver crashes on a stale stream or event (it segfaulted on
``cuStreamQuery``, ``cuEventRecord`` and ``cuEventElapsedTime``), so the daemon
must never pass one.

Thread safety: one lock guards the ordering state (tails, legacy barrier,
stream lists) and keeps queue order equal to tail order. It is never held while
waiting or running work, and never together with the driver's table lock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError

_log = logging.getLogger(__name__)

_INVALID_HANDLE = CUresult.CUDA_ERROR_INVALID_HANDLE
_CONTEXT_IS_DESTROYED = CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED

T = TypeVar("T")
#: What a stream runs: a callable that does the copy or fill (None for an event record or a wait).
Work = Callable[[], object]


class Marker(threading.Event):
    """The completion of one work item; ``time`` is ``time.perf_counter()`` when it completed."""

    time = 0.0

    def complete(self) -> None:
        self.time = time.perf_counter()
        self.set()


def _done(marker: Marker | None) -> bool:
    return marker is None or marker.is_set()


def _pending(*markers: Marker | None) -> list[Marker]:
    """The markers that are not done yet."""
    return [marker for marker in markers if marker is not None and not marker.is_set()]


_Item = tuple[Work | None, list[Marker], Marker]
_thread_numbers = itertools.count(1)


class SimStream:
    """A simulated ``CUstream``: a FIFO queue of work and the thread that runs it.

    ``tail`` is the marker of the last work queued (None before any); ``error`` the
    first failure not reported yet. Compared by identity, like the driver's handles.
    """

    __slots__ = ("_queue", "_thread", "alive", "context", "error", "legacy", "non_blocking", "tail")

    def __init__(self, context: HasStreams, non_blocking: bool, legacy: bool = False) -> None:
        self.context = context
        self.non_blocking = non_blocking
        self.legacy = legacy
        self.alive = True
        self.tail: Marker | None = None
        self.error: CudaError | None = None
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, item: _Item) -> None:
        """Queue one item, starting the executor thread on the first; call under the scheduler lock."""
        if self._thread is None:
            kind = "legacy" if self.legacy else "stream"
            self._thread = threading.Thread(target=self._run, name=f"sim-{kind}-{next(_thread_numbers)}", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def stop(self) -> None:
        """Let the executor end once the work queued so far is done."""
        if self._thread is not None:
            self._queue.put(None)

    def take_error(self) -> CudaError | None:
        error, self.error = self.error, None
        return error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, waits, marker = item
            for earlier in waits:
                earlier.wait()
            if work is not None:
                try:
                    work()
                except CudaError as failure:
                    self.error = self.error or failure
                except Exception as failure:
                    _log.exception("sim stream work failed on %r", self)
                    detail = f"{type(failure).__name__}: {failure}"
                    self.error = self.error or CudaError.of(CUresult.CUDA_ERROR_UNKNOWN, detail)
            marker.complete()

    def __repr__(self) -> str:
        kind = "legacy" if self.legacy else "non-blocking" if self.non_blocking else "blocking"
        state = "" if self.alive else ", destroyed"
        return f"<SimStream {kind} of {self.context!r}{state}>"


class SimEvent:
    """A simulated ``CUevent``; ``marker`` is that of its latest record (None: never recorded)."""

    __slots__ = ("alive", "context", "marker", "timing")

    def __init__(self, context: HasStreams, timing: bool) -> None:
        self.context = context
        self.timing = timing
        self.alive = True
        self.marker: Marker | None = None

    def __repr__(self) -> str:
        state = "" if self.alive else ", destroyed"
        return f"<SimEvent of {self.context!r}{state}>"


class StreamSet:
    """The streams and events of one context, and its legacy stream.

    ``streams`` keeps destroyed streams until their queue has drained, because the
    legacy stream still orders against them. ``legacy_tail`` is the marker of the
    latest legacy-stream work: queued, or a synchronous call running on its thread.
    """

    __slots__ = ("events", "legacy", "legacy_tail", "streams")

    def __init__(self) -> None:
        self.streams: list[SimStream] = []
        self.events: set[SimEvent] = set()
        self.legacy: SimStream | None = None
        self.legacy_tail: Marker | None = None


class HasStreams(Protocol):
    """What the scheduler needs of a context: its :class:`StreamSet`."""

    stream_set: StreamSet


class StreamScheduler:
    """Creates streams and events and orders all work queued on them; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    # --- streams -----------------------------------------------------------------------

    def create_stream(self, context: HasStreams, non_blocking: bool) -> SimStream:
        stream = SimStream(context, non_blocking)
        with self._lock:
            context.stream_set.streams.append(stream)
        return stream

    def destroy_stream(self, handle: object) -> None:
        """Returns at once: the queued work still runs, then the executor thread ends."""
        with self._lock:
            stream = _live_stream(handle)
            stream.alive = False
            stream.stop()

    def check_stream(self, handle: object | None) -> None:
        """``CUDA_ERROR_INVALID_HANDLE`` unless ``handle`` is None or a live stream."""
        if handle is not None:
            _live_stream(handle)

    def query(self, handle: object) -> bool:
        stream = _live_stream(handle)
        _raise_pending(stream)
        return _done(stream.tail)

    def synchronize(self, handle: object) -> None:
        stream = _live_stream(handle)
        tail = stream.tail
        if tail is not None:
            tail.wait()
        _raise_pending(stream)

    def synchronize_context(self, context: HasStreams) -> None:
        """Wait for every stream of the context (destroyed ones still draining too) and its legacy stream."""
        with self._lock:
            streams = context.stream_set
            everything = [*streams.streams, *([streams.legacy] if streams.legacy else [])]
            tails = _pending(*(stream.tail for stream in everything), streams.legacy_tail)
        for tail in tails:
            tail.wait()
        for stream in everything:
            _raise_pending(stream)

    def is_idle(self, context: HasStreams, handle: object | None) -> bool:
        """Whether work queued now on ``handle`` (None: the legacy stream) would run at once."""
        with self._lock:
            if handle is None:
                streams = context.stream_set
                return _done(streams.legacy_tail) and not self._blocking_tails(streams)
            stream = _live_stream(handle)
            return _done(stream.tail) and (stream.non_blocking or _done(stream.context.stream_set.legacy_tail))

    def retire(self, context: HasStreams) -> None:
        """Destroy every stream and event of a context being destroyed, then wait for their queued work."""
        with self._lock:
            streams, context.stream_set = context.stream_set, StreamSet()
            everything = [*streams.streams, *([streams.legacy] if streams.legacy else [])]
            for stream in everything:
                stream.alive = False
                stream.stop()
            for event in streams.events:
                event.alive = False
            tails = _pending(*(stream.tail for stream in everything))
        for tail in tails:
            tail.wait()

    # --- ordering ---------------------------------------------------------------------

    def submit(
        self, context: HasStreams | None, handle: object | None, work: Work | None, after: Marker | None = None
    ) -> Marker:
        """Queue ``work`` on a stream (None: the legacy stream of ``context``); its marker is returned.

        ``after`` is one more marker to wait for (``stream_wait_event``).
        """
        with self._lock:
            if handle is None:
                assert context is not None, "the legacy stream is the current context's"
                streams = context.stream_set
                target = streams.legacy
                if target is None:
                    target = streams.legacy = SimStream(context, non_blocking=False, legacy=True)
                waits = self._blocking_tails(streams)
            else:
                target = _live_stream(handle)
                streams = target.context.stream_set
                waits = []
            if not target.non_blocking:
                waits += _pending(streams.legacy_tail)
            waits += _pending(after)
            marker = Marker()
            target.tail = marker
            if target.legacy:
                streams.legacy_tail = marker
            target.put((work, waits, marker))
        return marker

    def run_legacy(self, context: HasStreams, work: Callable[[], T]) -> T:
        """Run a synchronous call on the caller's thread as legacy-stream work, and return its result.

        It first waits for earlier work on the legacy stream and on every blocking
        stream; meanwhile work queued on them waits for it. With nothing to wait
        for it just runs, without touching the ordering state.
        """
        streams = context.stream_set
        if not streams.streams and _done(streams.legacy_tail):
            return work()  # the common case: nothing queued in this context
        with self._lock:
            waits = self._blocking_tails(streams) + _pending(streams.legacy_tail)
            if not waits:
                barrier = None
            else:
                barrier = streams.legacy_tail = Marker()
        if barrier is None:
            return work()
        try:
            for earlier in waits:
                earlier.wait()
            return work()
        finally:
            barrier.complete()

    def _blocking_tails(self, streams: StreamSet) -> list[Marker]:
        """Unfinished tails of the blocking streams; drops destroyed streams that drained. Under the lock."""
        tails = []
        drained = False
        for stream in streams.streams:
            tail = stream.tail
            if tail is None or tail.is_set():
                drained = drained or not stream.alive
            elif not stream.non_blocking:
                tails.append(tail)
        if drained:
            streams.streams = [stream for stream in streams.streams if stream.alive or not _done(stream.tail)]
        return tails

    # --- events -----------------------------------------------------------------------

    def create_event(self, context: HasStreams, timing: bool) -> SimEvent:
        event = SimEvent(context, timing)
        with self._lock:
            context.stream_set.events.add(event)
        return event

    def destroy_event(self, handle: object) -> None:
        """Waits that already refer to its record still complete, as in CUDA."""
        with self._lock:
            event = _live_event(handle)
            event.alive = False
            event.context.stream_set.events.discard(event)

    def record(self, handle: object, stream: object | None, context: HasStreams | None) -> None:
        """Record on ``stream`` (None: the legacy stream of ``context``, the current one)."""
        event = _live_event(handle)
        owner = context if stream is None else _live_stream(stream).context
        if owner is not event.context:
            raise CudaError.of(_INVALID_HANDLE, "the event and the stream belong to different contexts")
        event.marker = self.submit(context, stream, None)

    def event_query(self, handle: object) -> bool:
        return _done(_live_event(handle, _CONTEXT_IS_DESTROYED).marker)

    def event_synchronize(self, handle: object) -> None:
        marker = _live_event(handle, _CONTEXT_IS_DESTROYED).marker
        if marker is not None:
            marker.wait()

    def elapsed_ms(self, start_handle: object, end_handle: object) -> float:
        """As cuEventElapsedTime: ``INVALID_HANDLE`` without timing or a record, ``NOT_READY`` before both are done."""
        start, end = _live_event(start_handle), _live_event(end_handle)
        if not (start.timing and end.timing):
            raise CudaError.of(_INVALID_HANDLE, "an event was created with timing disabled")
        if start.marker is None or end.marker is None:
            raise CudaError.of(_INVALID_HANDLE, "an event was never recorded")
        if start.context is not end.context:
            raise CudaError.of(_INVALID_HANDLE, "the events belong to different contexts")
        if not (start.marker.is_set() and end.marker.is_set()):
            raise CudaError.of(CUresult.CUDA_ERROR_NOT_READY)
        return (end.marker.time - start.marker.time) * 1000.0

    def wait_event(self, stream: object, handle: object) -> None:
        """Later work on ``stream`` waits for the event's latest record; a no-op if it has none or it is done."""
        _live_stream(stream)
        marker = _live_event(handle).marker
        if not _done(marker):
            self.submit(None, stream, None, after=marker)


def _live_stream(handle: object) -> SimStream:
    if not isinstance(handle, SimStream) or not handle.alive or handle.legacy:
        raise CudaError.of(_INVALID_HANDLE, f"{handle!r} is not a live stream")
    return handle


def _live_event(handle: object, destroyed: CUresult = _INVALID_HANDLE) -> SimEvent:
    """The event, or ``CUDA_ERROR_INVALID_HANDLE`` (``destroyed`` for one that was destroyed)."""
    if not isinstance(handle, SimEvent):
        raise CudaError.of(_INVALID_HANDLE, f"{handle!r} is not an event")
    if not handle.alive:
        raise CudaError.of(destroyed, f"{handle!r}")
    return handle


def _raise_pending(stream: SimStream) -> None:
    error = stream.take_error()
    if error is not None:
        raise error
