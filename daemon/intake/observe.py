"""What the front thread reports about each request and session: log lines and (opt-in) metrics.

:class:`RequestObserver` is called from two places in :mod:`cuctxd.daemon.front.loop`: at
the end of ``Front._handle`` (every request; front ops and failures are
finished there) and where worker replies are forwarded (device ops finish
there, so their latency runs from the request's arrival to its reply leaving).
Device lanes (:mod:`cuctxd.daemon.worker.lane`) call :meth:`RequestObserver.finished` from
their worker threads as each reply leaves; it only logs and updates thread-safe
metrics. :class:`ObservedSessions` is the session registry that logs every
session opened and closed and counts reaps, on the front thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cuctxd.daemon.registry.sessions import Session, SessionRegistry
from cuctxd.protos.errors import CuctxError, ErrorCode
from cuctxd.protos.messages import unpack
from cuctxd.protos.schema import OPS

log = logging.getLogger("cuctxd.daemon.requests")
session_log = logging.getLogger("cuctxd.daemon.sessions")


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class MetricsSink(Protocol):
    """Where observations go (the service's Prometheus metrics); safe to call from any thread."""

    @property
    def sessions_opened(self) -> Counter: ...
    @property
    def sessions_closed(self) -> Counter: ...
    @property
    def sessions_reaped(self) -> Counter: ...

    def observe(self, op: str, outcome: str, seconds: float) -> None: ...


OK = "ok"
#: Device requests awaiting their reply are remembered up to this many (a worker that died never answers).
_MAX_PENDING = 65536
#: Error outcomes that are part of normal operation, not worth a warning each.
_QUIET = {ErrorCode.CUCTXD_ERROR_SHUTTING_DOWN.name, ErrorCode.CUCTXD_ERROR_INTERNAL.name}


#: Failures of one kind (op and error) logged one by one per window; the rest are counted, and one line per
#: window says how many (a client sending 10,000 bad requests a second must not write 10,000 log lines).
WARN_BURST = 10
WARN_WINDOW_S = 10.0


class RepeatLimiter:
    """How many warnings of each kind to log: the first ``burst`` of a ``window``-second window, then only a
    count. Any thread may call (one lock); the kinds are few (ops times error names), and a kind is forgotten
    once its window has ended and been reported."""

    def __init__(self, burst: int = WARN_BURST, window: float = WARN_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.window = window
        self.clock = clock
        #: kind -> [window start, warnings logged in it, warnings held back in it]
        self._kinds: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()

    def allow(self, kind: tuple[str, str]) -> tuple[bool, int]:
        """Whether to log this warning, and how many of its kind the window before held back (to report now)."""
        now = self.clock()
        with self._lock:
            entry = self._kinds.get(kind)
            held = 0
            if entry is None or now - entry[0] >= self.window:
                held = 0 if entry is None else int(entry[2])
                entry = self._kinds[kind] = [now, 0, 0]
            if entry[1] < self.burst:
                entry[1] += 1
                return True, held
            entry[2] += 1
            return False, held

    def ended(self) -> list[tuple[tuple[str, str], int]]:
        """The kinds whose window has ended, with how many warnings each held back (those with none too,
        counted 0); forgotten here."""
        now = self.clock()
        with self._lock:
            done = [kind for kind, entry in self._kinds.items() if now - entry[0] >= self.window]
            return [(kind, int(self._kinds.pop(kind)[2])) for kind in done]


class RequestObserver:
    """Counts and times requests, logs one line per failure (at most :data:`WARN_BURST` of each op and error
    per :data:`WARN_WINDOW_S`, then a count; and one per request at DEBUG)."""

    def __init__(self, metrics: MetricsSink | None = None, warnings: RepeatLimiter | None = None) -> None:
        self.metrics = metrics
        self.warnings = RepeatLimiter() if warnings is None else warnings
        self._pending: dict[tuple[bytes, int], tuple[str, float]] = {}

    def handled(self, identity: bytes, request_id: int, op: str, outcome: str, started: float) -> None:
        """The front is done with a request: answered (front op, error) or queued to a worker."""
        spec = OPS.get(op)
        if outcome == OK and spec is not None and spec.target == "device":
            if len(self._pending) >= _MAX_PENDING:
                self._pending.pop(next(iter(self._pending)))
            self._pending[(identity, request_id)] = (op, started)
            return
        self.finished(op, outcome, started, request_id)

    def replied(self, frames: Sequence[Any]) -> None:
        """A worker's reply ``[identity, header, *payload]`` is about to leave."""
        if not self._pending or len(frames) < 2:
            return
        try:
            header = unpack(frames[1].buffer)
        except CuctxError:
            return
        if not isinstance(header, dict):
            return
        request_id = header.get("id")
        if not isinstance(request_id, int):
            return
        entry = self._pending.pop((frames[0].bytes, request_id), None)
        if entry is None:
            return  # a fan-out reply (status, goodbye): counted when the front handled it
        error = header.get("error")
        outcome = OK if header.get("ok") else str(error.get("name", "UNKNOWN") if isinstance(error, dict) else "?")
        self.finished(entry[0], outcome, entry[1], request_id)

    @property
    def in_flight(self) -> int:
        """Device requests queued or running whose reply has not left yet."""
        return len(self._pending)

    def finished(self, op: str, outcome: str, started: float, request_id: int) -> None:
        """A request has been answered: count, time and log it (any thread: device lanes call it too)."""
        if outcome == OK and self.metrics is None and not log.isEnabledFor(logging.DEBUG):
            return  # nothing to count or log: the common case costs no clock read
        latency = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.observe(op, outcome, latency)
        if outcome.startswith("CUCTXD_") and outcome not in _QUIET:
            allowed, held = self.warnings.allow((op, outcome))
            if held:
                _held_back(op, outcome, held, self.warnings.window)
            if allowed:
                log.warning("request %d (%s) failed: %s", request_id, op, outcome,
                            extra=_fields(op, outcome, request_id, latency))
            elif log.isEnabledFor(logging.DEBUG):  # the per-request record stays whole at DEBUG
                log.debug("request %d (%s) failed: %s", request_id, op, outcome,
                          extra=_fields(op, outcome, request_id, latency))
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("request %d (%s): %s in %.3f ms", request_id, op, outcome, latency * 1e3,
                      extra=_fields(op, outcome, request_id, latency))


    def report_held_back(self) -> None:
        """Log how many failures of each kind were held back in windows that have ended (the front calls
        it every second or so, so that a flood that stops is still summed up)."""
        for (op, outcome), held in self.warnings.ended():
            if held:
                _held_back(op, outcome, held, self.warnings.window)


def _held_back(op: str, outcome: str, held: int, window: float) -> None:
    log.warning("%d more requests (%s) failed with %s within %.0f s: not logged one by one", held, op, outcome,
                window, extra={"op": op, "outcome": outcome, "suppressed": held})


def _fields(op: str, outcome: str, request_id: int, latency: float) -> dict[str, Any]:
    return {"op": op, "outcome": outcome, "request_id": request_id, "latency_ms": round(latency * 1e3, 3)}


class ObservedSessions(SessionRegistry):
    """The front's session registry, with an INFO line per session opened or closed.

    Reaps are logged where they happen (``Front._reap``); here they are only counted.
    """

    def __init__(self, metrics: MetricsSink | None = None, receivers: int = 1) -> None:
        super().__init__(receivers)
        self.metrics = metrics

    def open(self, client: str, pid: int, peer: str = "", uid: int | None = None, fd_peer: str = "",
             devices: frozenset[int] | None = None) -> Session:
        session = super().open(client, pid, peer, uid, fd_peer, devices)
        ref = session.ref
        session_log.info("session %d opened by %s (pid %d)", ref.public_id, ref.client, ref.pid,
                         extra={"session": ref.public_id, "client": ref.client, "pid": ref.pid})
        if self.metrics is not None:
            self.metrics.sessions_opened.inc()
        return session

    def close(self, token: str, closed_by: str | None = None) -> Session | None:
        session = super().close(token, closed_by)
        if session is not None:
            ref = session.ref
            lived = time.time() - session.opened_at
            by = "" if closed_by is None else f" by {closed_by}"
            session_log.info("session %d (%s, pid %d) closed%s after %.1f s", ref.public_id, ref.client, ref.pid,
                             by, lived, extra={"session": ref.public_id, "client": ref.client, "pid": ref.pid,
                                               "lived_s": round(lived, 3)})
            if self.metrics is not None:
                self.metrics.sessions_closed.inc()
        return session

    def expire(self, now: float, ttl: float) -> list[Session]:
        stale = super().expire(now, ttl)
        if stale and self.metrics is not None:
            self.metrics.sessions_reaped.inc(len(stale))
        return stale
