"""The shm lanes' requests in and replies out: how the worker takes a request from a session's lane and answers it.

The worker polls each lane's request eventfd beside its ROUTER, takes the request from the region
(:func:`take`), admits and runs it as any other (same checks, same queues, same order: the client sends on
one path at a time), and answers in the region (:func:`reply`). An **early** request (sent before the
bytes it copies from are in place) is checked at once, but its copy waits parked on its lane
(:func:`park`) for the lane's next ring (:func:`unpark`), and its reply, even an error, is rung only after
that ring: so no ring the client owes can meet a later request. The worker never waits to ring: both
eventfds are non-blocking, and a lane whose client filled the reply eventfd's counter is closed at the ring
that fails (:func:`_ring`). What a lane holds: :mod:`cuctxd.daemon.device.shm_lanes`; its layout:
:mod:`cuctxd.protos.shm_lane`. Worker thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from cuctxd.daemon.device.shm_lanes import ShmLane, ShmLanes
from cuctxd.protos.errors import TooLarge
from cuctxd.protos.messages import encode_error
from cuctxd.protos.shm_lane import MESSAGE_HEAD, REPLY_AT, REQUEST_AT, fits, is_early, read_message, write_message

log = logging.getLogger(__name__)


def take(lanes: ShmLanes, fd: int) -> tuple[ShmLane, bytes, bytes | None] | None:
    """The request the lane polled on ``fd`` rang for: ``(lane, header, payload)``; None when there is
    none to take (a ring while the last one is still being answered, an early request's data ring, or a
    number already taken). A message that does not fit its area raises :class:`BadRequest` (answered on
    the lane)."""
    lane = lanes.by_fd.get(fd)
    if lane is None:
        return None
    count = 0
    with contextlib.suppress(BlockingIOError):
        count = os.eventfd_read(fd)
    if lane.busy:  # an early request's data ring; else the client broke the one-at-a-time rule (its
        lane.rung += count  # request waits for this reply)
        return None
    if lane.owing and count:  # the data ring an early request's reply waited for
        count -= 1
        lane.owing = False
        if not _ring(lanes, lane):
            return None
        if not count:
            return None
    seq = MESSAGE_HEAD.unpack_from(lane.view, REQUEST_AT)[0]
    if seq == lane.seq:
        return None
    lane.seq, lane.busy = seq, True  # from here on, even garbage is answered, under its number
    lane.early, lane.rung = is_early(lane.view, seq), max(0, count - 1)
    _, header, payload = read_message(lane.view, REQUEST_AT)
    return lane, header, payload


def park(lanes: ShmLanes, lane: ShmLane, job: Any, pending: Any) -> None:
    """Keep an early copy on its lane until the lane's data ring (:func:`unpark`)."""
    lane.parked = (job, pending)
    lanes.parked += 1


def unpark(lanes: ShmLanes, fd: int) -> tuple[Any, Any] | None:
    """The early copy parked on the lane polled on ``fd``, once its data ring has come."""
    lane = lanes.by_fd.get(fd)
    if lane is None or lane.parked is None or not lane.rung:
        return None
    parked, lane.parked = lane.parked, None
    lanes.parked -= 1
    return parked


def reply(lanes: ShmLanes, lane: ShmLane, request_id: int, header: bytes, frames: Sequence[Any]) -> None:
    """Answer the lane's request (a lane closed meanwhile is skipped); a reply that does not fit its area
    is answered with ``CUCTXD_ERROR_TOO_LARGE`` instead. An early request's reply is rung only once its
    data ring has come."""
    if lanes.by_session.get(lane.session.token) is not lane:
        return
    payload: Any = memoryview(frames[0]).cast("B") if frames else None
    if len(frames) > 1 or not fits(len(header), 0 if payload is None else len(payload)):
        error = TooLarge(f"the reply ({len(header)} header bytes and {len(frames)} frame(s)) does not fit the "
                         "shm lane's area; send this request over the socket")
        header, payload = encode_error(request_id, error), None
    write_message(lane.view, REPLY_AT, lane.seq, header, payload)
    owing = lane.early and not lane.rung  # rung with the data ring still to come
    lane.busy, lane.early, lane.rung = False, False, 0
    if owing:
        lane.owing = True
    else:
        _ring(lanes, lane)


def _ring(lanes: ShmLanes, lane: ShmLane) -> bool:
    """Ring ``lane``'s reply eventfd; a lane whose client filled the eventfd's counter is closed (logged
    once): its session's requests take the socket from then on. False if so."""
    if lane.ring():
        return True
    session = lane.session
    log.warning("session %d (%s, pid %d): its shm lane closed: the client filled the reply eventfd's counter, "
                "so it cannot be rung; the session's requests take the socket", session.public_id,
                session.client, session.pid)
    lanes.close(lane.session.token)
    return False
