"""Client sessions as the front thread sees them: tokens, public ids, current device.

A session is cuctxd's stand-in for a CUDA host thread. This registry is owned
by the front thread; device workers only ever see the immutable
:class:`SessionRef` carried in each job and keep their own per-device state.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SessionRef:
    """What a worker may know of a session: its secret token and public identity."""

    token: str
    public_id: int
    client: str
    pid: int


@dataclass
class Session:
    """Front-owned state of one session."""

    ref: SessionRef
    opened_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    current_device: int = 0
    #: Who opened it, for ``max_sessions_per_peer`` (:mod:`cuctxd.daemon.intake.peers`).
    peer: str = ""

    def to_status(self) -> dict[str, object]:
        return {
            "session": self.ref.public_id,
            "client": self.ref.client,
            "pid": self.ref.pid,
            "current_device": self.current_device,
            "opened_at": self.opened_at,
        }


#: How many reaped tokens are remembered, to answer "expired" rather than "unknown".
_EXPIRED_MEMORY = 4096


class SessionRegistry:
    """Token -> session, and recently reaped tokens; only the front thread calls it."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._public_ids = itertools.count(1)

    def open(self, client: str, pid: int, peer: str = "") -> Session:
        ref = SessionRef(secrets.token_hex(16), next(self._public_ids), client, pid)
        session = Session(ref, peer=peer)
        self._sessions[ref.token] = session
        return session

    def get(self, token: str) -> Session | None:
        return self._sessions.get(token)

    def close(self, token: str) -> Session | None:
        return self._sessions.pop(token, None)

    def expire(self, now: float, ttl: float) -> list[Session]:
        """Remove and return the sessions not heard from for ``ttl`` seconds."""
        stale = [s for s in self._sessions.values() if now - s.last_seen > ttl]
        for session in stale:
            del self._sessions[session.ref.token]
            self._expired[session.ref.token] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        return stale

    def count_peer(self, peer: str) -> int:
        """Open sessions of ``peer``."""
        return sum(1 for s in self._sessions.values() if s.peer == peer)

    def was_expired(self, token: str) -> bool:
        return token in self._expired

    def __len__(self) -> int:
        return len(self._sessions)

    def all(self) -> list[Session]:
        return list(self._sessions.values())
