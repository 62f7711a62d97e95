"""A device worker's job runner: runs each job, continuation and fan-out part, and answers it where it came from.

The poll loop (:mod:`cuctxd.daemon.worker.loop`) owns the thread and watches the ways in; it hands the
runner what they bring: jobs the front queued as tasks (:meth:`JobRunner.queue_sent`), jobs the device's own
ROUTER admitted (:meth:`JobRunner.queue_received`), an shm lane's ring (:meth:`JobRunner.take_shm`). Jobs
wait in :class:`~cuctxd.daemon.worker.queues.JobQueues` (one FIFO per session, bounded, served
round-robin); a lane request without payload that finds nothing queued runs at once instead, as it is
received: its turn has come, and the trip through the queues (a batch received before its first job runs,
replies sent in a burst) cost small reads a third of their throughput. A job runs through its device
handler; what the handler hands back is answered at once (:class:`~cuctxd.daemon.handlers.replies.Reply`),
polled between requests until it passes (:class:`~cuctxd.daemon.handlers.replies.Pending`, so a
synchronize never blocks the worker), or passed to another device's worker
(:class:`~cuctxd.daemon.handlers.replies.Forward`). Every reply leaves through one of the runner's
destinations (:mod:`cuctxd.daemon.worker.destinations`), chosen by where the job came in; reply payloads
are tracked until ZeroMQ lets go of them (``max_reply_bytes``). Worker thread only, but for
:meth:`JobRunner.waiting`, which other threads read for the worker's queue depth.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers import DEVICE_HANDLERS
from cuctxd.daemon.handlers.replies import FanOut, Forward, Gather, Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.sessions import DeviceBacklog, Session
from cuctxd.daemon.worker import shm_io
from cuctxd.daemon.worker.destinations import (
    Destination,
    FrontReplies,
    LaneReplies,
    PeerLaneReplies,
    PeerWorker,
    ShmReplies,
)
from cuctxd.daemon.worker.lane import DeviceLane
from cuctxd.daemon.worker.queues import HeldReplies, JobQueues, taken
from cuctxd.protos.cuda_results import STICKY_CODES, CUresult
from cuctxd.protos.errors import BadRequest, CuctxError, CudaError, InternalError, ShuttingDown, UnknownSession
from cuctxd.protos.messages import encode_error, encode_result

log = logging.getLogger(__name__)

#: Bounds of the back-off between polls of pending synchronizations.
POLL_MIN_S = 0.000_02
POLL_MAX_S = 0.001
#: Outcome a request's observer hears for a reply that is not an error.
_OK = "ok"


class JobRunner:
    """Runs device ``state.device``'s jobs and answers them; made by its worker thread once the device is open."""

    def __init__(self, state: DeviceState, peers: Mapping[int, PeerWorker], to_front: FrontReplies,
                 queue_limits: QueueLimits, silenced: threading.Event) -> None:
        """``peers``: every device's worker, by device (cross-device ops). ``silenced``: set once the drain
        deadline has passed; from then on no job runs and no reply leaves."""
        self.device = state.device
        self.state = state
        self.peers = peers
        self.silenced = silenced
        self.queues = JobQueues(queue_limits)
        #: Jobs whose handler returned :class:`Pending`, polled between requests.
        self.pending: list[tuple[Job, Pending]] = []
        #: Backlogs with reply payloads ZeroMQ may still hold, by peer (a drain waits until they have left;
        #: ``max_reply_bytes_per_peer``).
        self.replying = HeldReplies()
        self.to_front = to_front
        self.to_peer_lane = PeerLaneReplies(peers)
        #: The device's own ROUTER (the shm lanes' requests are admitted as its own) and the destinations
        #: of the jobs that came in on it or on an shm lane; None until the worker adopts its lane.
        self.lane: DeviceLane | None = None
        self._own: tuple[LaneReplies, ShmReplies] | None = None

    def open_lane(self, lane: DeviceLane) -> None:
        """The worker adopted its own ROUTER: answer what comes in on it, or on an shm lane, there."""
        self.lane = lane
        self._own = (LaneReplies(lane), ShmReplies(self.state.shm_lanes, lane))

    def waiting(self) -> int:
        """Jobs queued, pending synchronizations and early copies parked on their shm lanes; any thread."""
        return len(self.queues) + len(self.pending) + self.state.shm_lanes.parked

    # --- the ways in ----------------------------------------------------------------------

    def queue_received(self, job: Job) -> None:
        """Run or queue a job this worker's lane admitted; raises the :class:`LimitExceeded` to answer it with."""
        if self.queues.count or job.payload or job.backlog is None or job.backlog.after:
            self.queues.push(job)
        else:
            self._run_job(job)

    def queue_sent(self, job: Job) -> None:
        """Queue a job the front handed on, or answer it with the limit it meets."""
        try:
            self.queues.push(job)
        except CuctxError as exc:
            taken(job)
            self._fail(job, exc)

    def take_shm(self, fd: int) -> None:
        """A session rang its shm lane: admit and run (or queue) its request, or answer it with its error."""
        assert self.lane is not None and self._own is not None
        to_shm = self._own[1]
        lanes = self.state.shm_lanes
        received = time.perf_counter()
        try:
            taken = shm_io.take(lanes, fd)
        except BadRequest as exc:  # a message that does not fit its area: answered there
            to_shm.answer(lanes.by_fd[fd], 0, "?", encode_error(0, exc), (), exc.name, received)
            return
        if taken is None:
            parked = shm_io.unpark(lanes, fd)
            if parked is not None:  # its data ring: the loop runs it next
                self.pending.append(parked)
            return
        lane, header, payload = taken
        refused = self.lane.admit(b"", header, () if payload is None else (payload,), self.queue_received,
                                  received, lane)
        if refused is not None:
            request_id, op_name, error = refused
            to_shm.answer(lane, request_id, op_name, encode_error(request_id, error), (), error.name, received)

    # --- running ------------------------------------------------------------------------------

    def run_next(self) -> None:
        """Run the job whose turn it is (:meth:`JobQueues.pop`), then the work waiting for its session's
        queue to empty, then poll the pending synchronizations."""
        job = self.queues.pop()
        self._run_job(job)
        self._run_after(job.backlog)
        if self.pending:
            self.poll_pending()

    def poll_pending(self) -> None:
        still: list[tuple[Job, Pending]] = []
        for job, pending in self.pending:
            try:
                done = pending.done()
            except BaseException as exc:
                self._fail(job, exc)
                continue
            if not done:
                still.append((job, pending))
                continue
            try:
                reply = pending.then()
            except BaseException as exc:
                self._fail(job, exc)
                continue
            self._deliver(job, reply)
        self.pending = still

    def mute(self) -> None:
        """Silenced: forget pending synchronizations (they are not answered)."""
        self.pending = []

    def run_quietly(self, work: Callable[[DeviceState], None]) -> None:
        try:
            work(self.state)
        except Exception:
            log.exception("device %d: background task failed", self.device)

    def held_reply_bytes(self) -> int:
        return self.replying.total()

    def _run_job(self, job: Job) -> None:
        taken(job)
        if self.silenced.is_set():
            return
        backlog = job.backlog
        if backlog is not None:
            if backlog.ended:
                self._fail(job, UnknownSession("the session ended before this request ran"))
                return
            if job.spec.payload_out:
                try:
                    self.replying.check_room(_peer(job), backlog, self.queues.limits)
                except CuctxError as exc:
                    self._fail(job, exc)
                    return
        if self.state.failure is not None:
            failure = self.state.failure
            self._fail(job, CudaError(failure.code, failure.name, f"device {self.device} is unusable since "
                                      f"{failure.name} ({failure.message}); restart the daemon"))
            return
        try:
            outcome = DEVICE_HANDLERS[job.spec.name](self.state, job)
        except BaseException as exc:
            self._fail(job, exc)
            return
        self._deliver(job, outcome)

    def _deliver(self, job: Job, outcome: Reply | Pending | Forward) -> None:
        if isinstance(outcome, Reply):
            self.answer(job, encode_result(job.request_id, outcome.result), outcome.frames, _OK)
            return
        if isinstance(outcome, Pending):
            if outcome.on_ring is not None:
                shm_io.park(self.state.shm_lanes, outcome.on_ring, job, outcome)
            else:
                self.pending.append((job, outcome))
            return
        peer = self.peers.get(outcome.device)
        if peer is None:
            self._fail(job, CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE, f"no device {outcome.device}"))
            return
        peer.forward(job, outcome)

    def carry_on(self, job: Job, forward: Forward) -> None:
        """Go on with ``job`` here with ``forward.then`` (a front op's, or the rest of another device's)."""
        if self.silenced.is_set():
            return
        try:
            outcome = forward.then(self.state)
        except BaseException as exc:
            self._fail(job, exc)
            return
        self._deliver(job, outcome)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if isinstance(exc, CudaError) and exc.code in STICKY_CODES and self.state.failure is None:
            self.state.failure = exc
            log.error("device %d: sticky %s in %s; this device now refuses all work, other devices go on",
                      self.device, exc.name, job.spec.name)
        if isinstance(exc, CuctxError):
            error: CuctxError = exc
            log.debug("device %d: %s failed: %s", self.device, job.spec.name, exc)
        else:
            log.exception("device %d: internal error in %s", self.device, job.spec.name)
            error = InternalError(f"{type(exc).__name__} in {job.spec.name}; see the daemon log")
        self.answer(job, encode_error(job.request_id, error), (), error.name)

    def after_queued(self, session: Session, work: Callable[[], None]) -> None:
        """Run ``work`` once ``session``'s jobs queued on this device have run (now, if none are), as
        PROTOCOL.md says of a closing session; from then on its jobs still to come are refused."""
        backlog = session.backlogs[self.device] if self.device < len(session.backlogs) else None
        if backlog is None:
            work()
            return
        backlog.after.append(work)
        self._run_after(backlog)

    def _run_after(self, backlog: DeviceBacklog | None) -> None:
        """Run the work waiting for ``backlog``'s queued jobs (:meth:`after_queued`) once none is left."""
        if backlog is None or not backlog.after or backlog.jobs:
            return
        backlog.ended = True
        after, backlog.after = backlog.after, []
        for work in after:
            work()

    def run_fan_out(self, identity: bytes, request_id: int, gather: Gather, fan_out: FanOut) -> None:
        """This device's part of a front op every worker contributes to; the last one's reply goes to the front."""
        if self.silenced.is_set():
            return
        if fan_out.after is not None:
            after, fan_out = fan_out.after, dataclasses.replace(fan_out, after=None)
            self.after_queued(after, lambda: self.run_fan_out(identity, request_id, gather, fan_out))
            return
        try:
            part = fan_out.each(self.state)
        except Exception as exc:
            log.exception("device %d: fan-out part failed", self.device)
            part = {"device": self.device, "error": f"{type(exc).__name__}: {exc}"}
        reply = gather.contribute(self.device, part)
        if reply is not None:
            self.to_front.send(identity, encode_result(request_id, reply.result), reply.frames)

    # --- the ways out -------------------------------------------------------------------------

    def answer(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str) -> None:
        """Reply where ``job`` came from (:meth:`_destination`).

        Payload frames of a job of this device are tracked on its session's backlog (only this worker
        writes it), for ``max_reply_bytes`` and ``max_reply_bytes_per_peer``. Nothing is sent once the worker
        is silenced."""
        if self.silenced.is_set():
            return
        backlog = job.backlog if frames and job.device == self.device else None
        trackers = self._destination(job).reply(job, header, frames, outcome, backlog is not None)
        if backlog is not None and trackers:
            self.replying.track(_peer(job), backlog, trackers)

    def _destination(self, job: Job) -> Destination:
        """The front (the job came through it), this device's lane or one of its shm lanes (it came in
        here), or another device's lane (the second half of a cross-device op that came in there)."""
        if job.lane is None:
            return self.to_front
        own = self._own
        if job.lane == self.device and own is not None:
            return own[0] if job.shm is None else own[1]
        return self.to_peer_lane

    # --- at the end ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Whatever ended the loop (a stop, a drain past its deadline, an error): first stop scrubbing and freeing
        shared memory (:meth:`Sharing.stop`), then answer or drop what is queued and close every session."""
        state = self.state
        state.sharing.stop()
        while self.queues:
            job = self.queues.pop()
            taken(job)
            if not self.silenced.is_set():
                self._fail(job, ShuttingDown("cuctxd is shutting down; this request was queued and did not run"))
            self._run_after(job.backlog)
        while self.pending and not self.silenced.is_set():  # answer synchronizes in flight first
            self.poll_pending()
            time.sleep(POLL_MAX_S)
        for session in list(state.sessions.values()):
            try:
                state.close_session(session.ref)
            except CuctxError as exc:
                log.warning("device %d: closing session %d at shutdown: %s",
                            self.device, session.ref.public_id, exc)
        while state.closing:
            self.run_quietly(DeviceState.close_more)
        left = state.sharing.left_at_stop()
        if left is not None:
            log.info("%s", left)
        try:
            state.host.kept.release()
            state.contexts.release_kept()
        except CuctxError as exc:
            log.warning("device %d: releasing the kept primary context at shutdown: %s", self.device, exc)
        state.shm_lanes.close_all()
        state.host.close()


def _peer(job: Job) -> str:
    """Whose replies ``max_reply_bytes_per_peer`` adds up: the session's fd peer (its own token where none is known)."""
    return job.session.fd_peer or job.session.token
