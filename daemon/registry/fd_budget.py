"""The daemon's file descriptors, planned from its open-file limit, and the budget of those it holds for clients.

Running out of descriptors is fatal: libzmq aborts the whole process when a
listener cannot accept (``Too many open files (src/ipc_listener.cpp)``). So the
open-file limit (``RLIMIT_NOFILE``, raised to the hard limit at start) is split
once, at start, in three parts that together never pass it (:class:`FdPlan`):

* the **reserve**, kept for the daemon itself (its sockets, eventfds, logs, the
  backend's files) and for the connections a paused listener still accepts;
* **connections** (``max_connections``): client connections on every ROUTER,
  counted by :class:`~cuctxd.daemon.registry.connection_budget.ConnectionBudget`;
* **client fds** (``max_client_fds``): every descriptor the daemon holds on a
  client's behalf: a ticket's fds until redeemed or expired, an shm lane's
  memfd, eventfds and mapping, a host buffer's mapping (Python's ``mmap`` keeps
  its own descriptor), fd channel connections, a shareable buffer's pool of its
  own (a device without VMM), the sim's memfd of an exported VMM buffer.
  :class:`FdBudget` counts them,
  daemon-wide and per peer (``max_client_fds_per_peer``) and per session
  (``max_client_fds_per_session``), so that one client cannot take what every
  other needs.

A peer here is what :func:`fd_peer` says: a user other than the daemon's (a
``--group`` member) as a whole, else one process. The budget is shared by the
front, the device workers and the fd channel thread: one lock.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.settings import count
from cuctxd.protos.errors import LimitExceeded

log = logging.getLogger(__name__)

#: Where an unlimited budget stops counting (unit tests, a daemon without a plan).
UNLIMITED = 1 << 62
#: Peers listed in ``status`` (those holding the most).
STATUS_PEERS = 8


def fd_reserve(open_files: int) -> int:
    """Descriptors kept for the daemon itself at an open-file limit of ``open_files``."""
    return max(open_files // 4, min(128, open_files // 2))


def fd_peer(uid: int | None, pid: int | None, other: str = "") -> str:
    """Whom the fds held for a client count against: ``uid:N`` for a process of another user than the
    daemon's (a ``--group`` member: all its processes together), else ``process:N``; ``other`` when the
    kernel did not say who it is (tcp://)."""
    if uid is not None and uid != os.getuid():
        return f"uid:{uid}"
    if pid is not None:
        return f"process:{pid}"
    return other


@dataclass(frozen=True)
class FdLimits:
    """The configured split of the open-file limit (0: derived from it, :meth:`FdPlan.derive`;
    :mod:`cuctxd.daemon.settings`)."""

    #: Most client connections on all sockets together (0: what the open-file limit leaves,
    #: :func:`cuctxd.daemon.intake.connections.connection_cap`).
    max_connections: int = count(0, "most client connections at once; beyond it new ones are refused until some "
                                 "close", shown="0: half of what the open-file limit leaves once a quarter of it is "
                                 "kept for the daemon; the other half is max_client_fds", security=True, limit=True)
    #: Fds the daemon may hold for clients (tickets, shm lanes, host buffers, fd channel connections): in all,
    #: per peer, per session; 0: derived from the open-file limit
    #: (:class:`cuctxd.daemon.registry.fd_budget.FdPlan`). And fd channel connections of one peer.
    max_client_fds: int = count(0, "most fds the daemon holds for clients (tickets, shm lanes, host buffers, fd "
                                "channel connections)", shown="0: the open-file limit N less the daemon's reserve "
                                "max(N/4, min(128, N/2)) less max_connections", security=True, limit=True)
    max_client_fds_per_peer: int = count(0, "of those, most held for one peer: a process, or a group member's uid",
                                         shown="0: a quarter of max_client_fds", security=True, limit=True)
    max_client_fds_per_session: int = count(0, "of those, most held for one session",
                                            shown="0: an eighth of max_client_fds (at most the peer's share)",
                                            security=True, limit=True)


@dataclass(frozen=True)
class FdPlan:
    """How the open-file limit is split; :meth:`derive` makes it from the limit and the settings."""

    open_files: int
    reserve: int
    connections: int
    client_fds: int
    per_peer: int
    per_session: int

    @classmethod
    def derive(cls, open_files: int, limits: FdLimits = FdLimits()) -> FdPlan:
        """The plan at ``open_files``. Of what the reserve leaves (the room), connections take
        ``max_connections`` (0: half the room; never more than three quarters of it) and client fds the
        rest (``max_client_fds`` lowers it); a peer's share is ``max_client_fds_per_peer`` (0: a quarter of
        the client fds), a session's ``max_client_fds_per_session`` (0: an eighth), neither above the one
        that contains it. A configured value the limit does not allow is lowered, with a warning."""
        reserve = fd_reserve(open_files)
        room = max(2, open_files - reserve)
        most = max(1, room - room // 4)
        connections = _lowered("max_connections", limits.max_connections, most, open_files) or room // 2
        client_fds = _lowered("max_client_fds", limits.max_client_fds, room - connections, open_files) \
            or room - connections
        per_peer = _lowered("max_client_fds_per_peer", limits.max_client_fds_per_peer, client_fds, open_files) \
            or max(1, client_fds // 4)
        per_session = _lowered("max_client_fds_per_session", limits.max_client_fds_per_session, per_peer,
                               open_files) or max(1, min(per_peer, client_fds // 8))
        return cls(open_files, reserve, connections, client_fds, per_peer, per_session)


def _lowered(key: str, configured: int, most: int, open_files: int) -> int:
    if configured > most:
        log.warning("%s %d is more than the open-file limit %d allows: using %d", key, configured, open_files, most)
        return most
    return configured


class FdCharge:
    """Fds one holder (a ticket, a lane, a host buffer, a connection) counts against the budget.

    :meth:`release` gives them back once, however often it is called, from any thread.
    """

    __slots__ = ("_budget", "count", "peer", "session")

    def __init__(self, budget: FdBudget, count: int, peer: str, session: str | None) -> None:
        self._budget: FdBudget | None = budget
        self.count = count
        self.peer = peer
        self.session = session

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give(self)


class FdBudget:
    """The client fds the daemon holds, against :class:`FdPlan`'s caps; any thread (one lock)."""

    def __init__(self, plan: FdPlan | None = None) -> None:
        """``plan``: None for a budget that never refuses (it still counts)."""
        self.plan = plan
        self.limit = plan.client_fds if plan is not None else UNLIMITED
        self.per_peer = plan.per_peer if plan is not None else UNLIMITED
        self.per_session = plan.per_session if plan is not None else UNLIMITED
        self.held = 0
        self.refused = 0
        self._peers: dict[str, int] = {}
        self._sessions: dict[str, int] = {}
        self._lock = threading.Lock()

    def charge(self, count: int, what: str, peer: str, session: str | None = None) -> FdCharge:
        """Count ``count`` fds held for ``peer`` (and ``session``, where there is one) for ``what``; the
        caller releases the charge when it closes them. :class:`LimitExceeded`, naming the limit, when
        the session's, the peer's or the daemon's share would be passed (nothing is counted then)."""
        with self._lock:
            in_session = self._sessions.get(session, 0) if session is not None else 0
            in_peer = self._peers.get(peer, 0)
            refusal = None
            if session is not None and in_session + count > self.per_session:
                refusal = (f"max_client_fds_per_session: the session holds {in_session} fds in the daemon of "
                           f"{self.per_session}; {what} needs {count} more (redeem or let go of tickets, host "
                           "buffers, shm lanes or pools of their own first)")
            elif in_peer + count > self.per_peer:
                refusal = (f"max_client_fds_per_peer: this client ({peer}) holds {in_peer} fds in the daemon "
                           f"of {self.per_peer}; {what} needs {count} more")
            elif self.held + count > self.limit:
                refusal = (f"max_client_fds: the daemon holds {self.held} fds for its clients, of the "
                           f"{self.limit} its open-file limit leaves them; {what} needs {count} more; "
                           "try again later")
            if refusal is not None:
                self.refused += 1
                raise LimitExceeded(refusal)
            self.held += count
            self._peers[peer] = in_peer + count
            if session is not None:
                self._sessions[session] = in_session + count
        return FdCharge(self, count, peer, session)

    def _give(self, charge: FdCharge) -> None:
        with self._lock:
            self.held -= charge.count
            _take_from(self._peers, charge.peer, charge.count)
            if charge.session is not None:
                _take_from(self._sessions, charge.session, charge.count)

    def held_by(self, peer: str) -> int:
        with self._lock:
            return self._peers.get(peer, 0)

    def to_status(self) -> dict[str, Any]:
        """For ``status`` (any thread): the plan, what is held, and the peers holding the most."""
        with self._lock:
            top = sorted(self._peers.items(), key=lambda item: -item[1])[:STATUS_PEERS]
            held, refused, peers = self.held, self.refused, len(self._peers)
        status: dict[str, Any] = {"held": held, "refused": refused, "peers": peers,
                                  "top_peers": [{"peer": peer, "held": count} for peer, count in top]}
        if self.plan is not None:
            plan = self.plan
            status.update(open_files=plan.open_files, reserve=plan.reserve, max_connections=plan.connections,
                          max=plan.client_fds, max_per_peer=plan.per_peer, max_per_session=plan.per_session)
        return status


def _take_from(counts: dict[str, int], key: str, count: int) -> None:
    left = counts.get(key, 0) - count
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
