"""The device worker: the one thread that calls the driver for its device.

Work reaches it two ways. Other threads queue tasks (jobs the front received,
fan-outs, forwarded continuations) and ring an eventfd doorbell; clients send
device ops straight to its own ROUTER (:mod:`cuctxd.daemon.device.lane`). One poller waits on
both. Jobs from either route wait in :class:`~cuctxd.daemon.device.queues.JobQueues`
(one FIFO per session, bounded, served round-robin); between two jobs the worker
takes in whatever has arrived, so a session's long backlog delays another
session's op by about one op. A lane request without payload that finds nothing
queued runs at once instead, as it is received: its turn has come, and the trip
through the queues (a batch received before its first job runs, replies sent in
a burst) cost small reads a third of their throughput. ZeroMQ fair-queues the
lane's connections, so a flood on one reaches the worker interleaved with the
others' requests either way. It runs one item at a time, so its
:class:`DeviceState` needs no lock, and answers each job where it came from: over
its inproc PUSH socket to the front, or on its lane; reply payloads are tracked
until ZeroMQ lets go of them (``max_reply_bytes``). After a request it polls
without sleeping for ``busy_poll_us`` before it blocks again. A slow op here delays only this device; a synchronize
op does not even delay this device: it becomes a :class:`~cuctxd.daemon.handlers.replies.Pending`
that the loop polls between requests. Driver calls that do block the worker:
synchronous copies (``write``/``read``/``copy`` without a stream, which return
once the copy is done) and, in one case, ``cuCtxSynchronize``: an allocation
that finds the device out of memory while stream-ordered pools hold some
waits for pending frees before trying again (:meth:`~cuctxd.daemon.device.memory.Memory.alloc`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import zmq

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.lane import DeviceLane
from cuctxd.daemon.device.queues import HeldReplies, JobQueues, QueueLimits, taken
from cuctxd.daemon.device.shm_lanes import ShmLane
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers import DEVICE_HANDLERS
from cuctxd.daemon.handlers.replies import FanOut, Forward, Gather, Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.intake.router_io import REPLY_LINGER_MS, TRACK_FROM, readable
from cuctxd.daemon.registry.sessions import DeviceBacklog, Session
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.cuda_results import STICKY_CODES, CUresult
from cuctxd.protos.errors import BadRequest, CuctxError, CudaError, InternalError, ShuttingDown, UnknownSession
from cuctxd.protos.messages import encode_error, encode_result

log = logging.getLogger(__name__)

_SNDMORE = int(zmq.SNDMORE)  # a plain int: pyzmq's flag enums are slow to combine

#: Bounds of the back-off between polls of pending synchronizations.
_POLL_MIN_S = 0.000_02
_POLL_MAX_S = 0.001
_POLLIN = int(zmq.POLLIN)
#: Outcome a request's observer hears for a reply that is not an error.
_OK = "ok"

Task = Callable[["DeviceWorker"], None]


class WorkerStartError(RuntimeError):
    """A worker could not query or open its device."""


class DeviceWorker:
    """Owns device ``device``: its thread, its :class:`DeviceState`, its reply socket."""

    def __init__(
        self,
        driver: Driver,
        device: int,
        zmq_context: zmq.Context[Any],
        reply_endpoint: str,
        limits: DeviceLimits,
        shares: ShareRegistry,
        tickets: TicketBook,
        queue_limits: QueueLimits | None = None,
        busy_poll: float = 0.0,
    ) -> None:
        """``busy_poll``: seconds the thread keeps polling without sleeping after its last request
        (``busy_poll_us``)."""
        self.device = device
        self._driver = driver
        self._zmq_context = zmq_context
        self._reply_endpoint = reply_endpoint
        self._limits = limits
        self._shares = shares
        self._tickets = tickets
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self._doorbell, _POLLIN)
        self._lane: DeviceLane | None = None
        self._pending: list[tuple[Job, Pending]] = []
        #: Backlogs with reply payloads ZeroMQ may still hold, by peer (a drain waits until they have left;
        #: ``max_reply_bytes_per_peer``).
        self._replying = HeldReplies()
        self._queues = JobQueues(queue_limits or QueueLimits())
        self._busy_poll = busy_poll
        self._busy_until = 0.0
        self._started = threading.Event()
        self._silenced = threading.Event()
        self._start_error: BaseException | None = None
        self._socket: zmq.Socket[Any] | None = None
        self.peers: Mapping[int, DeviceWorker] = {}
        self.state: DeviceState | None = None
        self.thread = threading.Thread(target=self._run, name=f"cuctxd-device-{device}", daemon=True)

    # --- called from other threads ----------------------------------------------------

    def start(self, timeout: float = 60.0) -> DeviceState:
        """Start the thread and wait until it has queried its device."""
        self.thread.start()
        if not self._started.wait(timeout):
            raise WorkerStartError(f"device {self.device} worker did not start within {timeout:.0f} s")
        if self._start_error is not None or self.state is None:
            raise WorkerStartError(f"device {self.device}: {self._start_error}") from self._start_error
        return self.state

    def submit(self, job: Job) -> None:
        """Queue a job the front admitted (its backlog's ``sent`` already counts it)."""
        self.submit_task(lambda worker: worker._queue_sent(job))

    def submit_task(self, task: Task | None) -> None:
        """Queue ``task`` (None: stop) and wake the worker; any thread."""
        self._tasks.put(task)
        os.eventfd_write(self._doorbell, 1)

    def ring(self) -> None:
        """Wake the worker without a task, so that it polls its pending work at once (a digest check's helper
        thread finished hashing a chunk); any thread. A stopped worker's doorbell is gone: nothing to wake."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self._doorbell, 1)

    def run(self, work: Callable[[DeviceState], None]) -> None:
        """Queue fire-and-forget work on this device's state; failures are logged."""
        self.submit_task(lambda worker: worker._run_quietly(work))

    def forward(self, job: Job, forward: Forward) -> None:
        """Go on with ``job`` (a front op's, or another device's) here with ``forward.then``; this worker replies."""
        self.submit_task(lambda worker: worker._continue(job, forward))

    def close_session(self, session: Session) -> None:
        """Close ``session`` on this device once its requests queued here have run (reaping)."""
        ref = session.ref
        self.submit_task(lambda worker: worker._after_queued(
            session, lambda: worker._run_quietly(partial(DeviceState.close_session, ref=ref))))

    def fan_out(self, identity: bytes, request_id: int, gather: Gather, fan_out: FanOut) -> None:
        self.submit_task(lambda worker: worker._run_fan_out(identity, request_id, gather, fan_out))

    def open_lane(self, lane: DeviceLane) -> None:
        """Hand the worker its own ROUTER (bound, not used by any other thread since)."""
        self.submit_task(lambda worker: worker._adopt_lane(lane))

    def silence(self) -> None:
        """The drain deadline has passed: from now on run no queued or lane request and send no reply
        (what is queued or pending is dropped unanswered); :meth:`stop` still closes every session.
        Any thread; takes effect once the operation running now returns."""
        self._silenced.set()
        os.eventfd_write(self._doorbell, 1)

    def stop(self, timeout: float = 30.0) -> None:
        """Close every session on this device, then end the thread."""
        self.submit_task(None)
        self.thread.join(timeout)

    def close(self) -> None:
        """Release the doorbell once the thread has ended (:meth:`stop`); nothing may be queued after."""
        if not self.thread.is_alive() and self._doorbell >= 0:
            os.close(self._doorbell)
            self._doorbell = -1

    def held_replies(self, report: Callable[[int], None]) -> None:
        """Queue a count of the reply payload bytes ZeroMQ still holds for this device's clients (sent, not
        yet taken by a slow reader); ``report`` gets it on the worker thread, once everything queued before
        has run. Any thread."""
        self.submit_task(lambda worker: report(worker._held_reply_bytes()))

    def queue_depth(self) -> int:
        """Work not answered yet: queued tasks and jobs, pending synchronizations and early copies parked
        on their shm lanes."""
        parked = self.state.shm_lanes.parked if self.state is not None else 0
        return self._tasks.qsize() + len(self._queues) + len(self._pending) + parked

    # --- on the worker thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            info = self._driver.device_info(self.device)
            self.state = DeviceState(self._driver, self.device, info, self._limits, self._shares, self._tickets)
            self.state.worker_thread = self.thread
            self.state.digest_checks.wake = self.ring
            self._socket = self._zmq_context.socket(zmq.PUSH)
            self._socket.setsockopt(zmq.SNDHWM, 0)
            self._socket.setsockopt(zmq.LINGER, 1000)
            self._socket.connect(self._reply_endpoint)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> None:
        assert self.state is not None
        closing = self.state.closing
        idle_polls = 0
        queues = self._queues
        while True:
            if closing:  # a session's close goes on between requests: look for work, never wait
                ready = self._poller.poll(0)
            elif self._pending:
                # Poll soon after new work, then back off to at most 1 ms between queries; within the
                # busy-poll window, without sleeping (a request meanwhile is taken at once).
                if time.perf_counter() < self._busy_until:
                    ready = self._poller.poll(0)
                else:
                    ready = self._wait(min(_POLL_MAX_S, _POLL_MIN_S * (1 << min(idle_polls, 10))))
            else:
                ready = self._poll_busily() or self._wait(None)
            if self._silenced.is_set():
                self._mute()
            lane = self._lane
            for source, _ in ready:
                if source == self._doorbell:
                    os.eventfd_read(self._doorbell)
                    if not self._take_tasks():
                        return
                elif lane is not None and source is lane.router:
                    lane.take_requests(self._queue_received)
                elif isinstance(source, int):
                    self._take_shm(source)
            idle_polls = 0 if ready else idle_polls + 1
            while queues:
                job = queues.pop()
                self._run_job(job)
                self._run_after(job.backlog)
                if self._pending:
                    self._poll_pending()
                if queues and not self._take_arrivals():  # with none left, the poll below takes them
                    return
            if self._pending:
                self._poll_pending()
            if closing:
                self._run_quietly(DeviceState.close_more)
            elif self._busy_poll and any(source != self._doorbell for source, _ in ready):
                self._busy_until = time.perf_counter() + self._busy_poll  # a client's request came in

    def _poll_busily(self) -> list[tuple[Any, int]]:
        """What became ready while polling without sleeping, until ``busy_poll`` after the last request on
        the lane or an shm lane (not after a task, which the front queues on its own schedule too):
        a client's next request often follows its reply within microseconds, and waking a sleeping
        thread costs tens of them (more in a virtual machine)."""
        until = self._busy_until
        poll = self._poller.poll
        while time.perf_counter() < until:
            ready = poll(0)
            if ready:
                return ready
        return []

    def _take_arrivals(self) -> bool:
        """Between two jobs: take in what has come meanwhile (cheap checks, no poll), so that a new
        session's job joins the round before the next turn; False once told to stop. The doorbell's
        count is left for the next poll, which reads it and finds the tasks gone."""
        lane = self._lane
        if lane is not None and readable(lane.router):
            lane.take_requests(self._queue_received)
        if self._tasks.empty():
            return True
        return self._take_tasks()

    def _wait(self, seconds: float | None) -> list[tuple[Any, int]]:
        """What is ready (the doorbell, the lane's ROUTER) once something is, or ``seconds`` have passed
        (None: no limit). ZeroMQ polls in whole milliseconds, so shorter waits poll, sleep and poll."""
        if seconds is None:
            return self._poller.poll()
        if seconds >= 0.001:
            return self._poller.poll(int(seconds * 1000))
        ready = self._poller.poll(0)
        if ready:
            return ready
        time.sleep(seconds)
        return self._poller.poll(0)

    def _take_tasks(self) -> bool:
        """Run every queued task (a job is queued, not run); False once told to stop."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return True
            if task is None:
                return False
            task(self)

    def _mute(self) -> None:
        """Silenced: stop taking requests on the lane and forget pending synchronizations."""
        self._pending = []
        if self._lane is not None and self._lane.router in self._poller:
            self._poller.unregister(self._lane.router)
        if self.state is not None:
            for fd in list(self.state.shm_lanes.by_fd):
                self._watch_shm(fd, False)

    def _adopt_lane(self, lane: DeviceLane) -> None:
        self._lane = lane
        self._poller.register(lane.router, _POLLIN)
        if self.state is not None:  # shm lanes are admitted as this lane admits its requests
            self.state.shm_lanes.watch = self._watch_shm

    def _watch_shm(self, fd: int, on: bool) -> None:
        if on:
            self._poller.register(fd, _POLLIN)
        elif fd in self._poller:
            self._poller.unregister(fd)

    def _take_shm(self, fd: int) -> None:
        """A session rang its shm lane: admit and run (or queue) its request, or answer it with its error."""
        assert self.state is not None and self._lane is not None
        lanes = self.state.shm_lanes
        received = time.perf_counter()
        try:
            taken = lanes.take(fd)
        except BadRequest as exc:  # a message that does not fit its area: answered there
            self._answer_shm(lanes.by_fd[fd], 0, "?", encode_error(0, exc), (), exc.name, received)
            return
        if taken is None:
            parked = lanes.unpark(fd)
            if parked is not None:  # its data ring: the loop runs it next
                self._pending.append(parked)
            return
        lane, header, payload = taken
        refused = self._lane.admit(b"", header, () if payload is None else (payload,), self._queue_received,
                                   received, lane)
        if refused is not None:
            request_id, op_name, error = refused
            self._answer_shm(lane, request_id, op_name, encode_error(request_id, error), (), error.name, received)

    def _answer_shm(self, lane: ShmLane, request_id: int, op: str, header: bytes, frames: Sequence[Any], outcome: str,
                    received: float) -> None:
        """Answer a request that came through ``lane`` (copied into its region); the observer hears of it
        as of the ROUTER's requests."""
        assert self.state is not None and self._lane is not None
        self.state.shm_lanes.reply(lane, request_id, header, frames)
        self._lane.finished(op, outcome, received, request_id)

    def _poll_pending(self) -> None:
        still: list[tuple[Job, Pending]] = []
        for job, pending in self._pending:
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
        self._pending = still

    def _shutdown(self) -> None:
        """Whatever ended the loop (a stop, a drain past its deadline, an error): first stop scrubbing and freeing
        shared memory (:meth:`Sharing.stop`), then answer or drop what is queued and close every session."""
        assert self.state is not None and self._socket is not None
        self.state.sharing.stop()
        while self._queues:
            job = self._queues.pop()
            taken(job)
            if not self._silenced.is_set():
                self._fail(job, ShuttingDown("cuctxd is shutting down; this request was queued and did not run"))
            self._run_after(job.backlog)
        while self._pending and not self._silenced.is_set():  # answer synchronizes in flight first
            self._poll_pending()
            time.sleep(_POLL_MAX_S)
        for session in list(self.state.sessions.values()):
            try:
                self.state.close_session(session.ref)
            except CuctxError as exc:
                log.warning("device %d: closing session %d at shutdown: %s",
                            self.device, session.ref.public_id, exc)
        while self.state.closing:
            self._run_quietly(DeviceState.close_more)
        left = self.state.sharing.left_at_stop()
        if left is not None:
            log.info("%s", left)
        try:
            self.state.host.kept.release()
            self.state.contexts.release_kept()
        except CuctxError as exc:
            log.warning("device %d: releasing the kept primary context at shutdown: %s", self.device, exc)
        self.state.shm_lanes.close_all()
        self.state.host.close()
        self._socket.close()
        if self._lane is not None:
            self._lane.close(0 if self._silenced.is_set() else REPLY_LINGER_MS)

    def _held_reply_bytes(self) -> int:
        return self._replying.total()

    def _run_quietly(self, work: Callable[[DeviceState], None]) -> None:
        assert self.state is not None
        try:
            work(self.state)
        except Exception:
            log.exception("device %d: background task failed", self.device)

    def _queue_received(self, job: Job) -> None:
        """Run or queue a job this worker's lane admitted; raises the :class:`LimitExceeded` to answer it with."""
        if self._queues.count or job.payload or job.backlog is None or job.backlog.after:
            self._queues.push(job)
        else:
            self._run_job(job)

    def _queue_sent(self, job: Job) -> None:
        """Queue a job the front handed on, or answer it with the limit it meets."""
        try:
            self._queues.push(job)
        except CuctxError as exc:
            taken(job)
            self._fail(job, exc)

    def _run_job(self, job: Job) -> None:
        assert self.state is not None
        taken(job)
        if self._silenced.is_set():
            return
        backlog = job.backlog
        if backlog is not None:
            if backlog.ended:
                self._fail(job, UnknownSession("the session ended before this request ran"))
                return
            if job.spec.payload_out:
                try:
                    self._replying.check_room(_peer(job), backlog, self._queues.limits)
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
            self._answer(job, encode_result(job.request_id, outcome.result), outcome.frames, _OK)
            return
        if isinstance(outcome, Pending):
            if outcome.on_ring is not None:
                assert self.state is not None
                self.state.shm_lanes.park(outcome.on_ring, job, outcome)
            else:
                self._pending.append((job, outcome))
            return
        peer = self.peers.get(outcome.device)
        if peer is None:
            self._fail(job, CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE, f"no device {outcome.device}"))
            return
        peer.forward(job, outcome)

    def _continue(self, job: Job, forward: Forward) -> None:
        assert self.state is not None
        if self._silenced.is_set():
            return
        try:
            outcome = forward.then(self.state)
        except BaseException as exc:
            self._fail(job, exc)
            return
        self._deliver(job, outcome)

    def _fail(self, job: Job, exc: BaseException) -> None:
        assert self.state is not None
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
        self._answer(job, encode_error(job.request_id, error), (), error.name)

    def _after_queued(self, session: Session, work: Callable[[], None]) -> None:
        """Run ``work`` once ``session``'s jobs queued on this device have run (now, if none are), as
        PROTOCOL.md says of a closing session; from then on its jobs still to come are refused."""
        backlog = session.backlogs[self.device] if self.device < len(session.backlogs) else None
        if backlog is None:
            work()
            return
        backlog.after.append(work)
        self._run_after(backlog)

    def _run_after(self, backlog: DeviceBacklog | None) -> None:
        """Run the work waiting for ``backlog``'s queued jobs (:meth:`_after_queued`) once none is left."""
        if backlog is None or not backlog.after or backlog.jobs:
            return
        backlog.ended = True
        after, backlog.after = backlog.after, []
        for work in after:
            work()

    def _run_fan_out(self, identity: bytes, request_id: int, gather: Gather, fan_out: FanOut) -> None:
        assert self.state is not None
        if self._silenced.is_set():
            return
        if fan_out.after is not None:
            after, fan_out = fan_out.after, dataclasses.replace(fan_out, after=None)
            self._after_queued(after, lambda: self._run_fan_out(identity, request_id, gather, fan_out))
            return
        try:
            part = fan_out.each(self.state)
        except Exception as exc:
            log.exception("device %d: fan-out part failed", self.device)
            part = {"device": self.device, "error": f"{type(exc).__name__}: {exc}"}
        reply = gather.contribute(self.device, part)
        if reply is not None:
            self.send(identity, encode_result(request_id, reply.result), reply.frames)

    def _answer(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str) -> None:
        """Reply where ``job`` came from: the front, this device's lane, or another device's lane.

        Payload frames of a job of this device are tracked on its session's backlog (only this worker
        writes it), for ``max_reply_bytes`` and ``max_reply_bytes_per_peer``. Nothing is sent once the worker
        is silenced."""
        if self._silenced.is_set():
            return
        backlog = job.backlog if frames and job.device == self.device else None
        if job.lane is None:
            trackers = self.send(job.identity, header, frames, backlog is not None)
        elif job.lane == self.device and job.shm is not None and self._lane is not None and self.state is not None:
            self._answer_shm(job.shm, job.request_id, job.spec.name, header, frames, outcome, job.received)
            return
        elif job.lane == self.device and self._lane is not None:
            trackers = self._lane.reply(job.identity, job.request_id, job.spec.name, header, frames, outcome,
                                        job.received, backlog is not None)
        else:  # the second half of a cross-device op that came in on the other device's lane
            self.peers[job.lane].submit_task(lambda worker: worker._answer(job, header, frames, outcome))
            return
        if backlog is not None and trackers:
            self._replying.track(_peer(job), backlog, trackers)

    def send(self, identity: bytes, header: bytes, frames: Sequence[Any] = (),
             track: bool = False) -> list[tuple[Any, int]]:
        """To the front (which forwards it to the client ``identity``) over inproc. ``track``: return
        ``(MessageTracker, bytes)`` of each payload frame ZeroMQ sends without copying."""
        assert self._socket is not None
        socket = self._socket
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


def _peer(job: Job) -> str:
    """Whose replies ``max_reply_bytes_per_peer`` adds up: the session's fd peer (its own token where none is known)."""
    return job.session.fd_peer or job.session.token
