"""One-time tickets for the fd channel: file descriptors waiting for the client that may take them.

A device worker that hands a client fds (a pool's, a host buffer's memfd)
*issues* a ticket for them here and puts the ticket in its ZeroMQ reply; the fd
channel's thread (:mod:`cuctxd.daemon.side_channel`) *redeems* it when the
client presents it, once, before it expires, from a process of the session's
user. Shared between threads: every method runs under one lock. Bounded:
``max_per_session`` outstanding tickets per session, and a ticket's fds count
against the daemon's :class:`~cuctxd.daemon.registry.fd_budget.FdBudget` (per
session, per peer, in all) until it is redeemed, expires or is dropped; the fds
of expired, dropped or refused tickets are closed here.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.daemon.settings import count, seconds
from cuctxd.protos.errors import LimitExceeded, NotFound
from cuctxd.protos.fd_channel import TICKET_ID_BYTES

#: Defaults of ``fd_ticket_ttl`` (seconds) and ``max_tickets_per_session``.
DEFAULT_TICKET_TTL = 30.0
DEFAULT_MAX_TICKETS_PER_SESSION = 64


@dataclass(frozen=True)
class TicketLimits:
    """A ticket's life and the tickets one session may have waiting (:mod:`cuctxd.daemon.settings`)."""

    fd_ticket_ttl: float = seconds(DEFAULT_TICKET_TTL, "how long a ticket for the fd channel stays redeemable",
                                   security=True, limit=True)
    max_tickets_per_session: int = count(DEFAULT_MAX_TICKETS_PER_SESSION, "fd channel tickets one session may have "
                                         "waiting", zero="no limit", security=True, limit=True)


@dataclass
class _Ticket:
    session: str
    uid: int | None
    fds: list[int]
    info: dict[str, Any]
    secret: bytes
    expires: float
    charge: FdCharge


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class TicketBook:
    """Outstanding tickets by public id; see the module docstring."""

    def __init__(self, limits: TicketLimits = TicketLimits(), budget: FdBudget | None = None) -> None:
        """``budget``: the daemon's, which the device workers also charge for the fds they hold for
        clients (None: one of its own that never refuses)."""
        self.limits = limits
        self.budget = budget if budget is not None else FdBudget()
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        self._per_session: dict[str, int] = {}

    def issue(self, session: str, uid: int | None, fds: Sequence[int], info: Mapping[str, Any],
              peer: str = "") -> str:
        """A ticket for ``fds`` (owned by the book from now on: closed here if this raises) for ``session``,
        whose process runs as ``uid`` (None: not known, the ticket alone then proves who may take them);
        ``peer``: whose share of the fd budget they count in
        (:func:`~cuctxd.daemon.registry.fd_budget.fd_peer`; default the session alone)."""
        charge = None
        try:
            with self._lock:
                held = self._per_session.get(session, 0)
                if self.limits.max_tickets_per_session and held >= self.limits.max_tickets_per_session:
                    raise LimitExceeded(f"max_tickets_per_session: the session has {held} fd channel tickets not "
                                        "redeemed yet; redeem them (or let them expire) first")
                charge = self.budget.charge(len(fds), "a ticket", peer or session, session)
                public = secrets.token_bytes(TICKET_ID_BYTES)
                secret = secrets.token_bytes(32)
                self._tickets[public] = _Ticket(session, uid, list(fds), dict(info), secret,
                                                time.monotonic() + self.limits.fd_ticket_ttl, charge)
                self._per_session[session] = held + 1
        except BaseException:
            if charge is not None:
                charge.release()
            _close(fds)
            raise
        return (public + secret).hex()

    def redeem(self, ticket: bytes | str, peer_uid: int | None) -> tuple[list[int], dict[str, Any]]:
        """Take a ticket's fds (the caller owns them now) and info, once. An unknown, used or expired
        ticket, a wrong secret, or a peer of another user than the session's: :class:`NotFound`, the
        same for each, and a ticket whose secret or user was wrong is void from then on."""
        raw = bytes.fromhex(ticket) if isinstance(ticket, str) else ticket
        public, secret = raw[:TICKET_ID_BYTES], raw[TICKET_ID_BYTES:]
        with self._lock:
            entry = self._tickets.pop(public, None)
            if entry is not None:
                self._forget(entry)
        if entry is None:
            raise NotFound("no such fd channel ticket (never issued, used already, or expired)")
        entry.charge.release()  # the fd channel closes them once sent
        valid = hmac.compare_digest(entry.secret, secret) and entry.expires > time.monotonic()
        if not valid or (entry.uid is not None and peer_uid is not None and entry.uid != peer_uid):
            _close(entry.fds)
            raise NotFound("no such fd channel ticket (never issued, used already, or expired)")
        return entry.fds, entry.info

    def expire(self, now: float | None = None) -> int:
        """Close the fds of tickets past their time; how many went."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entries = self._take_where(lambda entry: entry.expires <= now)
        for entry in entries:
            _close(entry.fds)
            entry.charge.release()
        return len(entries)

    def drop_session(self, session: str) -> None:
        """The session ended: its tickets go, their fds closed."""
        with self._lock:
            if not self._per_session.get(session):
                return
            entries = self._take_where(lambda entry: entry.session == session)
        for entry in entries:
            _close(entry.fds)
            entry.charge.release()

    def close(self) -> None:
        with self._lock:
            entries = list(self._tickets.values())
            self._tickets.clear()
            self._per_session.clear()
        for entry in entries:
            _close(entry.fds)
            entry.charge.release()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"tickets": len(self._tickets), "fds": sum(len(e.fds) for e in self._tickets.values())}

    def _take_where(self, predicate: Callable[[_Ticket], bool]) -> list[_Ticket]:
        """Remove the tickets ``predicate`` picks (under the lock); the caller closes their fds outside it."""
        gone = [public for public, entry in self._tickets.items() if predicate(entry)]
        entries = [self._tickets.pop(public) for public in gone]
        for entry in entries:
            self._forget(entry)
        return entries

    def _forget(self, entry: _Ticket) -> None:
        left = self._per_session[entry.session] - 1
        if left:
            self._per_session[entry.session] = left
        else:
            del self._per_session[entry.session]
