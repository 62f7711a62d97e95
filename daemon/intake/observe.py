"""What the front thread reports about each request and session: log lines and (opt-in) metrics.

:class:`RequestObserver` is called from two places in :mod:`cuctxd.daemon.front.loop`: at
the end of ``Front._handle`` (every request; front ops and failures are
finished there) and where worker replies are forwarded (device ops finish
there, so their latency runs from the request's arrival to its reply leaving).
Device lanes (:mod:`cuctxd.daemon.device.lane`) call :meth:`RequestObserver.finished` from
their worker threads as each reply leaves; it only logs and updates thread-safe
metrics. :class:`ObservedSessions` is the session registry that logs every
session opened and closed and counts reaps, on the front thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
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


class RequestObserver:
    """Counts and times requests, logs one line per failure (and per request at DEBUG)."""

    def __init__(self, metrics: MetricsSink | None = None) -> None:
        self.metrics = metrics
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
            log.warning("request %d (%s) failed: %s", request_id, op, outcome,
                        extra=_fields(op, outcome, request_id, latency))
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("request %d (%s): %s in %.3f ms", request_id, op, outcome, latency * 1e3,
                      extra=_fields(op, outcome, request_id, latency))


def _fields(op: str, outcome: str, request_id: int, latency: float) -> dict[str, Any]:
    return {"op": op, "outcome": outcome, "request_id": request_id, "latency_ms": round(latency * 1e3, 3)}


class ObservedSessions(SessionRegistry):
    """The front's session registry, with an INFO line per session opened or closed.

    Reaps are logged where they happen (``Front._reap``); here they are only counted.
    """

    def __init__(self, metrics: MetricsSink | None = None, receivers: int = 1) -> None:
        super().__init__(receivers)
        self.metrics = metrics

    def open(self, client: str, pid: int, peer: str = "", uid: int | None = None, fd_peer: str = "") -> Session:
        session = super().open(client, pid, peer, uid, fd_peer)
        ref = session.ref
        session_log.info("session %d opened by %s (pid %d)", ref.public_id, ref.client, ref.pid,
                         extra={"session": ref.public_id, "client": ref.client, "pid": ref.pid})
        if self.metrics is not None:
            self.metrics.sessions_opened.inc()
        return session

    def close(self, token: str) -> Session | None:
        session = super().close(token)
        if session is not None:
            ref = session.ref
            lived = time.time() - session.opened_at
            session_log.info("session %d (%s, pid %d) closed after %.1f s", ref.public_id, ref.client, ref.pid,
                             lived, extra={"session": ref.public_id, "client": ref.client, "pid": ref.pid,
                                           "lived_s": round(lived, 3)})
            if self.metrics is not None:
                self.metrics.sessions_closed.inc()
        return session

    def expire(self, now: float, ttl: float) -> list[Session]:
        stale = super().expire(now, ttl)
        if stale and self.metrics is not None:
            self.metrics.sessions_reaped.inc(len(stale))
        return stale
