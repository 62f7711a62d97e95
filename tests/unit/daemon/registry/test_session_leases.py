"""Session leases: each receiving thread stamps its own slot, and the reaper goes by the latest."""

from __future__ import annotations

import time

from cuctxd.daemon.registry.sessions import SessionRegistry


def test_a_request_on_any_receiver_keeps_the_session_alive() -> None:
    sessions = SessionRegistry(receivers=3)  # the front and two device lanes
    session = sessions.open("unit", 1)
    assert len(session.seen) == 3
    now = time.monotonic()
    session.seen[:] = [now - 100.0, now - 100.0, now - 100.0]
    session.seen[2] = now  # device 1's lane admitted a request just now
    assert sessions.expire(now + 1.0, ttl=10.0) == []
    assert sessions.get(session.ref.token) is session


def test_a_session_silent_on_every_receiver_is_reaped() -> None:
    sessions = SessionRegistry(receivers=2)
    session = sessions.open("unit", 1)
    now = time.monotonic()
    session.seen[:] = [now - 20.0, now - 11.0]
    assert sessions.expire(now, ttl=10.0) == [session]
    assert sessions.get(session.ref.token) is None
    assert sessions.was_expired(session.ref.token)


def test_sessions_are_counted_by_peer_and_uid_and_found_by_public_id_as_they_come_and_go() -> None:
    """``hello``'s per-peer and per-uid limits and ``close_session`` read counts and an index kept as sessions
    open, close and are reaped, not a walk over every open session."""
    sessions = SessionRegistry()
    first = sessions.open("a", 1, peer="p1", uid=7)
    second = sessions.open("b", 2, peer="p1", uid=7)
    tcp = sessions.open("c", 3, peer="p2", uid=None)
    assert (sessions.count_peer("p1"), sessions.count_peer("p2"), sessions.count_uid(7)) == (2, 1, 2)
    assert sessions.by_public_id(second.ref.public_id) is second
    assert sessions.close(second.ref.token) is second
    assert sessions.by_public_id(second.ref.public_id) is None
    assert (sessions.count_peer("p1"), sessions.count_uid(7)) == (1, 1)
    now = time.monotonic()
    first.seen[:] = [now - 20.0]
    assert sessions.expire(now, ttl=10.0) == [first]
    assert (sessions.count_peer("p1"), sessions.count_uid(7), sessions.by_public_id(first.ref.public_id)) == (0, 0,
                                                                                                           None)
    assert sessions.by_public_id(tcp.ref.public_id) is tcp and sessions.count_peer("p2") == 1
