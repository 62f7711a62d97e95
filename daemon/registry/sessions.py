"""Client sessions as the front thread sees them: tokens, public ids, current device.

A session is cuctxd's stand-in for a CUDA host thread. This registry and its
:class:`Session` objects are owned by the front thread, which alone opens,
closes and reaps them. Device workers get the immutable :class:`SessionRef` in
each job and keep their own per-device state (``DeviceState``); a worker's lane
admits requests against this registry, reading it (single dict lookups, atomic
under the GIL) and writing only what :class:`Session` says it may.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass(frozen=True)
class SessionRef:
    """What a worker may know of a session: its secret token and public identity.

    ``uid``: the user the peer's process runs as, where the kernel said so (ipc://,
    :func:`cuctxd.daemon.intake.peers.uid_of`); None when unknown. ``fd_peer``: whose share of the
    daemon's fd budget the fds held for the session count in
    (:func:`cuctxd.daemon.registry.fd_budget.fd_peer`; empty: the session's own). ``devices``: the
    indices of the devices it may use (``gpu_limit``: its pod's GPUs); None: every one.
    """

    token: str
    public_id: int
    client: str
    pid: int
    uid: int | None = None
    fd_peer: str = ""
    devices: frozenset[int] | None = None


@dataclass(slots=True, eq=False)
class DeviceBacklog:
    """One session's requests waiting for, and replies leaving, one device's worker: what
    ``max_queued_requests``, ``max_queued_bytes`` and ``max_reply_bytes`` bound
    (:mod:`cuctxd.daemon.worker.queues`).

    Written by two threads, each field by one: ``sent``/``sent_bytes`` (device ops the front handed
    to the worker) by the front; everything else by that device's worker: ``taken``/``taken_bytes``
    (of the front's, those run or refused since), ``jobs`` (queued to run, from either route, in
    arrival order) and their payload ``queued_bytes``, ``replies`` (``(tracker, bytes)`` of reply
    payloads ZeroMQ still holds) and their sum ``reply_bytes``, ``after`` (work waiting for the
    jobs queued now: the session's close) and ``ended`` (the session is closed on this device, so
    a request a lane admitted just before the close is refused). Other threads only read the
    counts (``status``).
    """

    sent: int = 0
    sent_bytes: int = 0
    ended: bool = False
    after: list[Any] = field(default_factory=list)
    taken: int = 0
    taken_bytes: int = 0
    jobs: deque[Any] = field(default_factory=deque)
    queued_bytes: int = 0
    replies: deque[tuple[Any, int]] = field(default_factory=deque)
    reply_bytes: int = 0


@dataclass
class Session:
    """State of one session, owned by the front thread except where said.

    ``seen``: ``time.monotonic()`` of the session's last request per receiver —
    slot 0 the front, slot 1 + N device N's lane — each slot written only by the
    thread that owns that receiver; the front's reaper reads the latest.
    ``current_device``: written only while admitting this session's
    ``set_device``, on the thread that received it (the front, or the lane of the
    device it names); a client keeps its requests that reach one device in order
    across endpoints (``protos/PROTOCOL.md``, "Device endpoints"), so the next
    request that reads it is always admitted after the write.
    """

    ref: SessionRef
    opened_at: float = field(default_factory=time.time)
    seen: list[float] = field(default_factory=lambda: [time.monotonic()])
    current_device: int = 0
    #: Who opened it, for ``max_sessions_per_peer`` (:mod:`cuctxd.daemon.intake.peers`).
    peer: str = ""
    #: One per device, made at open (:class:`DeviceBacklog` says who writes what).
    backlogs: tuple[DeviceBacklog, ...] = ()

    def to_status(self) -> dict[str, object]:
        return {
            "session": self.ref.public_id,
            "client": self.ref.client,
            "pid": self.ref.pid,
            "current_device": self.current_device,
            "opened_at": self.opened_at,
            "devices": None if self.ref.devices is None else sorted(self.ref.devices),
        }


#: How many reaped (or closed by another session) tokens are remembered, to answer "expired" or "closed"
#: rather than "unknown".
_EXPIRED_MEMORY = 4096

K = TypeVar("K")


class SessionRegistry:
    """Token -> session, and recently reaped tokens; only the front thread calls it."""

    def __init__(self, receivers: int = 1) -> None:
        """``receivers``: how many threads admit requests (the front and one lane per device), each
        stamping its own slot of :attr:`Session.seen`."""
        self.receivers = receivers
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        #: Tokens of sessions another session closed (``close_session``), with who closed them.
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._public_ids = itertools.count(1)
        #: The open sessions by public id, and how many each peer and uid has open: ``close_session`` and
        #: ``hello``'s limits cost O(1), not a walk over every session.
        self._by_public_id: dict[int, Session] = {}
        self._per_peer: Counter[str] = Counter()
        self._per_uid: Counter[int | None] = Counter()

    def open(self, client: str, pid: int, peer: str = "", uid: int | None = None, fd_peer: str = "",
             devices: frozenset[int] | None = None) -> Session:
        ref = SessionRef(secrets.token_hex(16), next(self._public_ids), client, pid, uid, fd_peer, devices)
        backlogs = tuple(DeviceBacklog() for _ in range(self.receivers - 1))
        session = Session(ref, peer=peer, seen=[time.monotonic()] * self.receivers, backlogs=backlogs)
        self._sessions[ref.token] = session
        self._by_public_id[ref.public_id] = session
        self._per_peer[peer] += 1
        self._per_uid[uid] += 1
        return session

    def _forget(self, session: Session) -> None:
        """Take a closed or reaped session out of the indexes."""
        del self._by_public_id[session.ref.public_id]
        _count_down(self._per_peer, session.peer)
        _count_down(self._per_uid, session.ref.uid)

    def get(self, token: str) -> Session | None:
        return self._sessions.get(token)

    def close(self, token: str, closed_by: str | None = None) -> Session | None:
        """Remove the session; ``closed_by``: another session closed it (``close_session``), said to its
        client's next request (:meth:`closed_by`)."""
        if closed_by is not None:
            self._closed[token] = closed_by
            while len(self._closed) > _EXPIRED_MEMORY:
                self._closed.popitem(last=False)
        session = self._sessions.pop(token, None)
        if session is not None:
            self._forget(session)
        return session

    def closed_by(self, token: str) -> str | None:
        """Who closed the session of ``token``, when another session did (recently enough to remember)."""
        return self._closed.get(token)

    def by_public_id(self, public_id: int) -> Session | None:
        """The open session whose public id is ``public_id``."""
        return self._by_public_id.get(public_id)

    def expire(self, now: float, ttl: float) -> list[Session]:
        """Remove and return the sessions not heard from for ``ttl`` seconds."""
        stale = [s for s in self._sessions.values() if now - max(s.seen) > ttl]
        for session in stale:
            del self._sessions[session.ref.token]
            self._forget(session)
            self._expired[session.ref.token] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        return stale

    def count_peer(self, peer: str) -> int:
        """Open sessions of ``peer``."""
        return self._per_peer[peer]

    def count_uid(self, uid: int) -> int:
        """Open sessions of peers running as ``uid``, whichever process opened them."""
        return self._per_uid[uid]

    def was_expired(self, token: str) -> bool:
        return token in self._expired

    def __len__(self) -> int:
        return len(self._sessions)

    def all(self) -> list[Session]:
        return list(self._sessions.values())


def _count_down(tally: Counter[K], key: K) -> None:
    tally[key] -= 1
    if not tally[key]:
        del tally[key]
