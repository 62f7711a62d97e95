"""The worker's job queues: per-session FIFO, round-robin between sessions, limits named when met."""

from __future__ import annotations

import pytest

from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.sessions import Session, SessionRegistry
from cuctxd.daemon.worker.queues import HeldReplies, JobQueues, check_sent, taken
from cuctxd.protos.errors import LimitExceeded
from cuctxd.protos.schema import OPS


def _job(session: Session, n: int, payload: bytes = b"", lane: int | None = 0) -> Job:
    spec = OPS["write" if payload else "ping"]
    return Job(b"id", n, spec, None, session.ref, 0, (payload,) if payload else (), lane, 0.0, session.backlogs[0])


def test_sessions_take_turns_and_each_keeps_its_order() -> None:
    sessions = SessionRegistry(receivers=2)
    flood, bystander = sessions.open("flood", 1), sessions.open("bystander", 2)
    queues = JobQueues(QueueLimits())
    for n in range(100):
        queues.push(_job(flood, n))
    queues.push(_job(bystander, 1000))
    order = [queues.pop().request_id for _ in range(3)]
    assert order == [0, 1000, 1]  # the bystander's job runs after at most one of the flood's
    rest = [queues.pop().request_id for _ in range(len(queues))]
    assert rest == list(range(2, 100)) and not queues


def test_request_limit_refuses_at_once_and_names_it() -> None:
    sessions = SessionRegistry(receivers=2)
    flood, other = sessions.open("flood", 1), sessions.open("other", 2)
    queues = JobQueues(QueueLimits(max_queued_requests=3))
    for n in range(3):
        queues.push(_job(flood, n))
    with pytest.raises(LimitExceeded, match="max_queued_requests"):
        queues.push(_job(flood, 3))
    queues.push(_job(other, 4))  # per session: another session still queues
    assert len(queues) == 4
    queues.pop()
    queues.push(_job(flood, 5))  # room again once one has run


def test_byte_limit_counts_payloads_but_always_admits_one_request() -> None:
    sessions = SessionRegistry(receivers=2)
    session = sessions.open("flood", 1)
    queues = JobQueues(QueueLimits(max_queued_bytes=10))
    queues.push(_job(session, 0, b"x" * 50))  # alone in its queue: admitted however large
    with pytest.raises(LimitExceeded, match="max_queued_bytes"):
        queues.push(_job(session, 1, b"x"))
    queues.pop()
    queues.push(_job(session, 2, b"x" * 6))
    with pytest.raises(LimitExceeded, match="max_queued_bytes"):
        queues.push(_job(session, 3, b"x" * 5))
    assert session.backlogs[0].queued_bytes == 6


def test_the_fronts_tally_of_jobs_handed_on_is_bounded_too() -> None:
    sessions = SessionRegistry(receivers=2)
    session = sessions.open("flood", 1)
    limits = QueueLimits(max_queued_requests=2)
    backlog = session.backlogs[0]
    check_sent(backlog, 0, limits)
    check_sent(backlog, 0, limits)
    with pytest.raises(LimitExceeded, match="max_queued_requests"):
        check_sent(backlog, 0, limits)
    taken(_job(session, 1, lane=None))
    check_sent(backlog, 0, limits)



class _Tracker:
    """What :func:`track_reply` reads of a ZeroMQ ``MessageTracker``: whether ZeroMQ let go."""

    def __init__(self) -> None:
        self.done = False


def test_a_peers_sessions_share_one_tally_of_unread_replies() -> None:
    sessions = SessionRegistry(receivers=2)
    first, second, other = (sessions.open(name, 1).backlogs[0] for name in ("first", "second", "other"))
    limits = QueueLimits(max_reply_bytes=100, max_reply_bytes_per_peer=150)
    held = HeldReplies()
    trackers = [_Tracker() for _ in range(2)]
    held.track("process:1", first, [(trackers[0], 80)])
    held.check_room("process:1", second, limits)  # 80 held by the peer: room
    held.track("process:1", second, [(trackers[1], 80)])
    with pytest.raises(LimitExceeded, match=r"\): max_reply_bytes_per_peer: 160 bytes .* process:1"):
        held.check_room("process:1", second, limits)  # each session alone is under max_reply_bytes
    held.check_room("process:2", other, limits)  # another peer is not held back
    assert held.total() == 160
    trackers[0].done = True  # its client took the first reply
    held.check_room("process:1", second, limits)
    trackers[1].done = True
    assert held.total() == 0
