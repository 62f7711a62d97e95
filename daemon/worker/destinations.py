"""Where a device worker's replies leave: one object per way out, each with one ``reply()``.

The job runner (:meth:`~cuctxd.daemon.worker.runner.JobRunner.answer`) answers every job where it came in:

* :class:`FrontReplies`: a job the front handed on (it came in on the main ROUTER). Over the worker's inproc
  PUSH socket to the front, which forwards it on the main ROUTER (:mod:`cuctxd.daemon.front.loop`).
* :class:`LaneReplies`: a job this device's own ROUTER received. On that ROUTER
  (:meth:`~cuctxd.daemon.worker.lane.DeviceLane.reply`).
* :class:`ShmReplies`: a job a session's shm lane to this device carried. In the lane's region, then a ring
  of its reply eventfd (:func:`~cuctxd.daemon.worker.shm_io.reply`).
* :class:`PeerLaneReplies`: the second half of a cross-device op that came in on another device's lane.
  Handed to that device's worker, whose runner answers it on its own lane.

Replies without a job go the same ways out, one level down: a fan-out's (:meth:`FrontReplies.send`), and
the refusals of requests that were never admitted, on the lane (:meth:`DeviceLane.reply`) or an shm lane
(:meth:`ShmReplies.answer`). Each destination is used on its worker's thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import zmq

from cuctxd.daemon.device.shm_lanes import ShmLane, ShmLanes
from cuctxd.daemon.handlers.replies import Forward
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.intake.router_io import TRACK_FROM
from cuctxd.daemon.worker import shm_io
from cuctxd.daemon.worker.lane import DeviceLane

_SNDMORE = int(zmq.SNDMORE)  # a plain int: pyzmq's flag enums are slow to combine

#: ``(MessageTracker, bytes)`` of each payload frame ZeroMQ sent without copying (tracked for
#: ``max_reply_bytes``).
Trackers = list[tuple[Any, int]]


class Destination(Protocol):
    """A way out: answer ``job`` with ``header`` and payload ``frames``; ``outcome`` (``"ok"`` or an error's
    name) is what the request's observer hears. ``track``: return the trackers of the payload frames sent
    without copying (only the sockets have any)."""

    def reply(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str, track: bool) -> Trackers: ...


class PeerWorker(Protocol):
    """Another device's worker, as this one reaches it: by work queued on its thread (any thread may call)."""

    def forward(self, job: Job, forward: Forward) -> None: ...

    def answer(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str) -> None: ...


class FrontReplies:
    """To the front over inproc; the front forwards each reply to the client whose identity leads it."""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        """``socket``: the worker's PUSH socket, connected to the front's PULL; the worker closes it."""
        self.socket = socket

    def reply(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str, track: bool) -> Trackers:
        return self.send(job.identity, header, frames, track)

    def send(self, identity: bytes, header: bytes, frames: Sequence[Any] = (), track: bool = False) -> Trackers:
        """To the front (which forwards it to the client ``identity``) over inproc. ``track``: return
        ``(MessageTracker, bytes)`` of each payload frame ZeroMQ sends without copying."""
        socket = self.socket
        socket.send(identity, _SNDMORE)
        if not frames:
            socket.send(header)
            return []
        socket.send(header, _SNDMORE)
        trackers = []
        last = len(frames) - 1
        for index, frame in enumerate(frames):
            flags = _SNDMORE if index < last else 0
            if track and len(frame) >= TRACK_FROM:
                trackers.append((socket.send(frame, flags, copy=False, track=True), len(frame)))
            else:
                socket.send(frame, flags, copy=False)
        return trackers


class LaneReplies:
    """On this device's own ROUTER, to the client that sent the request there."""

    def __init__(self, lane: DeviceLane) -> None:
        self.lane = lane

    def reply(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str, track: bool) -> Trackers:
        return self.lane.reply(job.identity, job.request_id, job.spec.name, header, frames, outcome, job.received,
                               track)


class ShmReplies:
    """In the region of the shm lane the request came through; the observer hears of it through the lane
    (:meth:`DeviceLane.finished`), as of the ROUTER's requests."""

    def __init__(self, lanes: ShmLanes, lane: DeviceLane) -> None:
        self.lanes = lanes
        self.lane = lane

    def reply(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str, track: bool) -> Trackers:
        self.answer(job.shm, job.request_id, job.spec.name, header, frames, outcome, job.received)
        return []

    def answer(self, lane: ShmLane, request_id: int, op: str, header: bytes, frames: Sequence[Any], outcome: str,
               received: float) -> None:
        """Answer a request that came through ``lane`` (copied into its region), admitted or not."""
        shm_io.reply(self.lanes, lane, request_id, header, frames)
        self.lane.finished(op, outcome, received, request_id)


class PeerLaneReplies:
    """To the worker of the device whose lane received the request: the first half of a cross-device op ran
    there, the rest here (:class:`~cuctxd.daemon.handlers.replies.Forward`), and the reply leaves where the
    request came in."""

    def __init__(self, peers: Mapping[int, PeerWorker]) -> None:
        self.peers = peers

    def reply(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str, track: bool) -> Trackers:
        assert job.lane is not None
        self.peers[job.lane].answer(job, header, frames, outcome)
        return []
