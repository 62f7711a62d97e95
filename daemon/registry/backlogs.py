"""A session's backlog on one device as the daemon's limits and ``status`` see it: the limits on it, the
reply bytes it still leaves in ZeroMQ, and what ``status`` says of it.

The :class:`~cuctxd.daemon.registry.sessions.DeviceBacklog` itself lives with the sessions; the worker
loop fills and empties it (:mod:`cuctxd.daemon.worker.queues`). These are here, below the loop, because
the admission settings (:class:`~cuctxd.daemon.registry.daemon_state.AdmissionConfig`) hold the limits and
the ``status`` handler reports a backlog. Worker thread only, but for :class:`QueueLimits` (immutable).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cuctxd.daemon.registry.sessions import DeviceBacklog
from cuctxd.daemon.settings import count, size

#: Default of ``max_queued_requests``: twice the Python client's in-flight window (256 per socket), so a
#: client that pipelines through both the main and a device endpoint never meets it.
DEFAULT_MAX_QUEUED_REQUESTS = 512
#: Default of ``max_queued_bytes``: write payloads one session may have queued on one device.
DEFAULT_MAX_QUEUED_BYTES = 256 << 20
#: Default of ``max_reply_bytes``: read results one session may have waiting to leave one device.
DEFAULT_MAX_REPLY_BYTES = 256 << 20
#: Default of ``max_reply_bytes_per_peer``: the same, of all one peer's sessions together (two sessions' worth).
DEFAULT_MAX_REPLY_BYTES_PER_PEER = 512 << 20


@dataclass(frozen=True)
class QueueLimits:
    """Per session and device; 0: no limit (:mod:`cuctxd.daemon.settings`)."""

    #: Per session and device (:mod:`cuctxd.daemon.worker.queues`): requests queued, their payload bytes,
    #: and reply payload bytes its client has not taken.
    max_queued_requests: int = count(DEFAULT_MAX_QUEUED_REQUESTS, "most requests one session may have queued on "
                                     "each device", zero="no limit", security=True, limit=True)
    max_queued_bytes: int = size(DEFAULT_MAX_QUEUED_BYTES, "most payload bytes one session may have queued on each "
                                 "device, beyond its first request", zero="no limit", security=True, limit=True)
    max_reply_bytes: int = size(DEFAULT_MAX_REPLY_BYTES, "read results one session's client may leave untaken on "
                                "each device before its reads are refused", zero="no limit", security=True,
                                limit=True)
    #: Of all one peer's sessions together (:class:`~cuctxd.daemon.worker.queues.HeldReplies`).
    max_reply_bytes_per_peer: int = size(DEFAULT_MAX_REPLY_BYTES_PER_PEER, "read results one peer's clients may "
                                         "leave untaken on each device, all its sessions together, before their "
                                         "reads are refused", zero="no limit", security=True, limit=True)


def reply_bytes(backlog: DeviceBacklog, limit: int = 0) -> int:
    """Reply bytes ZeroMQ still holds for the session: forgets those sent from the front of the line
    and, when that leaves ``limit`` (0: none) or more, looks through the rest (out-of-order sends)."""
    replies = backlog.replies
    while replies and replies[0][0].done:
        backlog.reply_bytes -= replies.popleft()[1]
    if limit and backlog.reply_bytes >= limit:
        still = deque(entry for entry in replies if not entry[0].done)
        backlog.replies = still
        backlog.reply_bytes = sum(size for _, size in still)
    return backlog.reply_bytes


def backlog_status(backlog: DeviceBacklog) -> dict[str, int]:
    """A session's use on one device, for ``status`` (on that device's worker)."""
    return {
        "queued": len(backlog.jobs) + backlog.sent - backlog.taken - _front_jobs_queued(backlog),
        "queued_bytes": backlog.queued_bytes,
        "reply_bytes": reply_bytes(backlog),
    }


def _front_jobs_queued(backlog: DeviceBacklog) -> int:
    return sum(1 for job in backlog.jobs if job.lane is None)
