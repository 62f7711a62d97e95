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
