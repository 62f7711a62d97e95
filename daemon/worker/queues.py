"""A device worker's queue of jobs: one FIFO per session, served round-robin, bounded per session.

Every device op a worker runs waits here first, whichever route it came by (the
front's task queue or the worker's own lane). Each session has its own FIFO, the
:class:`~cuctxd.daemon.registry.sessions.DeviceBacklog` the job carries, so its
requests run in the order they arrived; the worker takes one job from each
session with work in turn (:meth:`JobQueues.pop`), so a session with hundreds of
requests queued delays another's by at most one op. ``max_queued_requests`` and
``max_queued_bytes`` bound each FIFO (:meth:`JobQueues.push` refuses at once);
``max_reply_bytes`` bounds the reply payloads a session has left in ZeroMQ that
its client has not taken (:func:`track_reply`, :func:`~cuctxd.daemon.registry.backlogs.reply_bytes`), and
``max_reply_bytes_per_peer`` those of all of one peer's sessions (:class:`HeldReplies`), so
that a client cannot multiply the first by opening sessions. Worker thread only, but for
:func:`check_sent`, which the front calls for the jobs it hands on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from cuctxd.daemon.intake.jobs import Job, payload_bytes
from cuctxd.daemon.registry.backlogs import QueueLimits, reply_bytes
from cuctxd.daemon.registry.sessions import DeviceBacklog
from cuctxd.protos.errors import LimitExceeded


class JobQueues:
    """Queued jobs of every session on one device; every call O(1). Worker thread only."""

    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        #: The backlogs with jobs queued, in the order they get their next turn.
        self._turns: deque[DeviceBacklog] = deque()
        #: Jobs queued in all, for :meth:`__len__` (read by other threads: drain, metrics).
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def push(self, job: Job) -> None:
        """Queue ``job`` behind its session's others; :class:`LimitExceeded` naming the limit when the
        session already has ``max_queued_requests`` jobs, or ``max_queued_bytes`` of payload with this one,
        queued here (a session with nothing queued may always queue one request, however large)."""
        backlog = job.backlog
        assert backlog is not None
        size = payload_bytes(job)
        jobs = backlog.jobs
        if jobs:
            _check_room(self.limits, len(jobs), backlog.queued_bytes, size, "queued on this device")
        else:
            self._turns.append(backlog)
        jobs.append(job)
        backlog.queued_bytes += size
        self.count += 1

    def pop(self) -> Job:
        """The next job to run: the oldest of the session whose turn it is (raises IndexError when empty)."""
        backlog = self._turns.popleft()
        job: Job = backlog.jobs.popleft()
        backlog.queued_bytes -= payload_bytes(job)
        if backlog.jobs:
            self._turns.append(backlog)
        self.count -= 1
        return job


def check_sent(backlog: DeviceBacklog, size: int, limits: QueueLimits) -> None:
    """On the front, before handing a job of ``size`` payload bytes to the worker: refuse it when the
    session's jobs handed on and not yet run or refused there reach a limit (so a worker that is busy
    for a long op cannot collect an unbounded task queue); else count it as sent."""
    waiting = backlog.sent - backlog.taken
    if waiting:
        _check_room(limits, waiting, backlog.sent_bytes - backlog.taken_bytes, size, "waiting for this device")
    backlog.sent += 1
    backlog.sent_bytes += size


def taken(job: Job) -> None:
    """The worker ran or refused a job the front handed it: count it off the front's tally."""
    backlog = job.backlog
    if backlog is not None and job.lane is None:
        backlog.taken += 1
        backlog.taken_bytes += payload_bytes(job)


def _check_room(limits: QueueLimits, count: int, queued_bytes: int, size: int, where: str) -> None:
    limit = limits.max_queued_requests
    if limit and count >= limit:
        raise LimitExceeded(f"max_queued_requests: the session already has {count} request(s) {where} "
                            f"(limit {limit}); wait for replies before sending more")
    limit = limits.max_queued_bytes
    if limit and queued_bytes + size > limit:
        raise LimitExceeded(f"max_queued_bytes: the session already has {queued_bytes} payload bytes {where}; "
                            f"{size} more would pass the limit of {limit}; wait for replies before sending more")


def track_reply(backlog: DeviceBacklog, trackers: Sequence[tuple[Any, int]]) -> None:
    """Count reply payloads handed to ZeroMQ (``(MessageTracker, bytes)``) until it lets go of them."""
    for tracker, size in trackers:
        if not tracker.done:
            backlog.replies.append((tracker, size))
            backlog.reply_bytes += size


def check_reply_room(backlog: DeviceBacklog, limits: QueueLimits) -> None:
    """Before running an op whose reply carries a payload: :class:`LimitExceeded` naming
    ``max_reply_bytes`` while the session's earlier replies still hold that much here."""
    limit = limits.max_reply_bytes
    if limit and backlog.reply_bytes and reply_bytes(backlog, limit) >= limit:
        raise LimitExceeded(f"max_reply_bytes: {backlog.reply_bytes} bytes of this session's earlier replies "
                            f"have not been taken by its client (limit {limit}); read them first")


class HeldReplies:
    """The backlogs whose reply payloads ZeroMQ may still hold, by peer: what a drain waits for
    (:meth:`total`) and ``max_reply_bytes_per_peer`` bounds (:meth:`check_room`). A peer is what the fd
    budget says (:attr:`cuctxd.daemon.registry.sessions.SessionRef.fd_peer`: a process, a ``--group``
    member's uid, a tcp:// address or CURVE key). Worker thread only."""

    def __init__(self) -> None:
        self._by_peer: dict[str, set[DeviceBacklog]] = {}

    def track(self, peer: str, backlog: DeviceBacklog, trackers: Sequence[tuple[Any, int]]) -> None:
        """:func:`track_reply`, and remember the backlog under ``peer`` while it holds any."""
        track_reply(backlog, trackers)
        if backlog.reply_bytes:
            self._by_peer.setdefault(peer, set()).add(backlog)

    def total(self) -> int:
        """Reply bytes ZeroMQ still holds for every session here; forgets the backlogs that hold none."""
        return sum(self._held(peer) for peer in list(self._by_peer))

    def check_room(self, peer: str, backlog: DeviceBacklog, limits: QueueLimits) -> None:
        """Before running an op whose reply carries a payload: :func:`check_reply_room`, then
        :class:`LimitExceeded` naming ``max_reply_bytes_per_peer`` while ``peer``'s sessions together
        still hold that much here."""
        check_reply_room(backlog, limits)
        limit = limits.max_reply_bytes_per_peer
        if not limit or peer not in self._by_peer or self._held(peer) < limit:
            return
        held = self._held(peer, limit)
        if held >= limit:
            raise LimitExceeded(f"max_reply_bytes_per_peer: {held} bytes of earlier replies to the sessions of "
                                f"{peer} have not been taken by their clients (limit {limit}); read them first")

    def _held(self, peer: str, limit: int = 0) -> int:
        """``peer``'s held reply bytes (with ``limit``: each backlog looked through, out-of-order sends)."""
        backlogs = self._by_peer[peer]
        held = _held_by(backlogs, 1 if limit else 0)
        if not held:
            del self._by_peer[peer]
        return held


def _held_by(backlogs: set[DeviceBacklog], limit: int) -> int:
    total = 0
    for backlog in list(backlogs):
        held = reply_bytes(backlog, limit)
        if held:
            total += held
        else:
            backlogs.discard(backlog)
    return total
