"""The device worker's thread and poll loop: the one thread that calls the driver for its device.

Work reaches it three ways. Other threads queue tasks (jobs the front received,
fan-outs, forwarded continuations) and ring an eventfd doorbell; clients send
device ops straight to its own ROUTER (:mod:`cuctxd.daemon.worker.lane`); a session
with an shm lane rings that lane's request eventfd (:mod:`cuctxd.daemon.worker.shm_io`).
One poller waits on all of them, and the loop hands what each brings to the worker's
:class:`~cuctxd.daemon.worker.runner.JobRunner`, which queues, runs and answers the jobs
(its destinations: :mod:`cuctxd.daemon.worker.destinations`). Between two jobs the loop
takes in whatever has arrived, so a session's long backlog delays another session's op
by about one op. ZeroMQ fair-queues the lane's connections, so a flood on one reaches the
worker interleaved with the others' requests either way. It runs one item at a time, so its
:class:`DeviceState` needs no lock. After a request it polls without sleeping for
``busy_poll_us`` before it blocks again. A slow op here delays only this device; a synchronize
op does not even delay this device: it becomes a :class:`~cuctxd.daemon.handlers.replies.Pending`
that the loop polls between requests. Driver calls that do block the worker:
synchronous copies (``write``/``read``/``copy`` without a stream, which return
once the copy is done) and, in one case, ``cuCtxSynchronize``: an allocation
that finds the device out of memory while stream-ordered pools hold some
waits for pending frees before trying again (:meth:`~cuctxd.daemon.device.memory.Memory.alloc`).
"""

from __future__ import annotations

import contextlib
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
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.replies import FanOut, Forward, Gather
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.intake.router_io import REPLY_LINGER_MS, readable
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.sessions import Session
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.daemon.worker.destinations import FrontReplies
from cuctxd.daemon.worker.lane import DeviceLane
from cuctxd.daemon.worker.runner import POLL_MAX_S, POLL_MIN_S, JobRunner

_POLLIN = int(zmq.POLLIN)
#: Seconds without a request before the worker moves on work nobody waits for (a version's digest,
#: :meth:`~cuctxd.daemon.device.digest_checks.DigestChecks.advance`): it takes nothing from a burst of requests.
BACKGROUND_IDLE_S = 0.05

#: Work another thread queues for the worker: run on its thread with its job runner.
Task = Callable[[JobRunner], None]


class WorkerStartError(RuntimeError):
    """A worker could not query or open its device."""


class DeviceWorker:
    """Owns device ``device``: its thread, its :class:`DeviceState`, its sockets and its poll loop; the
    jobs themselves are its :attr:`runner`'s."""

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
        self._queue_limits = queue_limits or QueueLimits()
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self._doorbell, _POLLIN)
        self._lane: DeviceLane | None = None
        self._busy_poll = busy_poll
        self._busy_until = 0.0
        self._started = threading.Event()
        self._silenced = threading.Event()
        self._start_error: BaseException | None = None
        self._socket: zmq.Socket[Any] | None = None
        self.peers: Mapping[int, DeviceWorker] = {}
        self.state: DeviceState | None = None
        #: Made on the thread once the device is open (:meth:`_run`).
        self.runner: JobRunner | None = None
        self.thread = threading.Thread(target=self._run, name=f"cuctxd-device-{device}", daemon=True)

    # --- called from other threads: the task queue ---------------------------------------

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
        self.submit_task(lambda runner: runner.queue_sent(job))

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
        self.submit_task(lambda runner: runner.run_quietly(work))

    def close_session(self, session: Session) -> None:
        """Close ``session`` on this device once its requests queued here have run (reaping)."""
        ref = session.ref
        self.submit_task(lambda runner: runner.after_queued(
            session, lambda: runner.run_quietly(partial(DeviceState.close_session, ref=ref))))

    def fan_out(self, identity: bytes, request_id: int, gather: Gather, fan_out: FanOut) -> None:
        self.submit_task(lambda runner: runner.run_fan_out(identity, request_id, gather, fan_out))

    def forward(self, job: Job, forward: Forward) -> None:
        """Go on with ``job`` (a front op's, or another device's) here with ``forward.then``; this worker replies."""
        self.submit_task(lambda runner: runner.carry_on(job, forward))

    def answer(self, job: Job, header: bytes, frames: Sequence[Any], outcome: str) -> None:
        """Queue the reply to a job that came in on this device's lane (or an shm lane) and finished on
        another device: it leaves here, where the request came in."""
        self.submit_task(lambda runner: runner.answer(job, header, frames, outcome))

    def open_lane(self, lane: DeviceLane) -> None:
        """Hand the worker its own ROUTER (bound, not used by any other thread since)."""
        self.submit_task(lambda runner: self._adopt_lane(runner, lane))

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
        self.submit_task(lambda runner: report(runner.held_reply_bytes()))

    def queue_depth(self) -> int:
        """Work not answered yet: queued tasks and jobs, pending synchronizations and early copies parked
        on their shm lanes."""
        runner = self.runner
        return self._tasks.qsize() + (runner.waiting() if runner is not None else 0)

    # --- on the worker thread: the poll loop ---------------------------------------------

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
            self.runner = JobRunner(self.state, self.peers, FrontReplies(self._socket), self._queue_limits,
                                    self._silenced)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop(self.runner)
        finally:
            self._shutdown(self.runner)

    def _loop(self, runner: JobRunner) -> None:
        assert self.state is not None
        closing = self.state.closing
        idle_polls = 0
        queues = runner.queues
        checks = self.state.digest_checks
        last_request = 0.0
        while True:
            if closing:  # a session's close goes on between requests: look for work, never wait
                ready = self._poller.poll(0)
            elif runner.pending or checks.busy():
                # Poll soon after new work, then back off to at most 1 ms between queries; within the
                # busy-poll window, without sleeping (a request meanwhile is taken at once).
                if time.perf_counter() < self._busy_until:
                    ready = self._poller.poll(0)
                else:
                    ready = self._wait(min(POLL_MAX_S, POLL_MIN_S * (1 << min(idle_polls, 10))))
            else:
                ready = self._poll_busily() or self._wait(None)
            if self._silenced.is_set():
                self._mute(runner)
            lane = self._lane
            for source, _ in ready:
                if source == self._doorbell:
                    os.eventfd_read(self._doorbell)
                    if not self._take_tasks(runner):
                        return
                elif lane is not None and source is lane.router:
                    lane.take_requests(runner.queue_received)
                elif isinstance(source, int):
                    runner.take_shm(source)
            idle_polls = 0 if ready else idle_polls + 1
            requested = any(source != self._doorbell for source, _ in ready)  # a client's, not a task or a ring
            if requested or queues:
                last_request = time.perf_counter()
            while queues:
                runner.run_next()
                if queues and not self._take_arrivals(runner):  # with none left, the poll below takes them
                    return
            if runner.pending:
                runner.poll_pending()
            if checks.busy():  # a digest found in the background (a version's), while no request comes
                checks.advance(idle=time.perf_counter() - last_request >= BACKGROUND_IDLE_S)
            if closing:
                runner.run_quietly(DeviceState.close_more)
            elif self._busy_poll and requested:
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

    def _take_arrivals(self, runner: JobRunner) -> bool:
        """Between two jobs: take in what has come meanwhile (cheap checks, no poll), so that a new
        session's job joins the round before the next turn; False once told to stop. The doorbell's
        count is left for the next poll, which reads it and finds the tasks gone."""
        lane = self._lane
        if lane is not None and readable(lane.router):
            lane.take_requests(runner.queue_received)
        if self._tasks.empty():
            return True
        return self._take_tasks(runner)

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

    def _take_tasks(self, runner: JobRunner) -> bool:
        """Run every queued task (a job is queued, not run); False once told to stop."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return True
            if task is None:
                return False
            task(runner)

    def _mute(self, runner: JobRunner) -> None:
        """Silenced: stop taking requests on the lane and forget pending synchronizations."""
        runner.mute()
        if self._lane is not None and self._lane.router in self._poller:
            self._poller.unregister(self._lane.router)
        if self.state is not None:
            for fd in list(self.state.shm_lanes.by_fd):
                self._watch_shm(fd, False)

    def _adopt_lane(self, runner: JobRunner, lane: DeviceLane) -> None:
        self._lane = lane
        self._poller.register(lane.router, _POLLIN)
        runner.open_lane(lane)
        if self.state is not None:  # shm lanes are admitted as this lane admits its requests
            self.state.shm_lanes.watch = self._watch_shm

    def _watch_shm(self, fd: int, on: bool) -> None:
        if on:
            self._poller.register(fd, _POLLIN)
        elif fd in self._poller:
            self._poller.unregister(fd)

    def _shutdown(self, runner: JobRunner) -> None:
        """Whatever ended the loop: the runner answers or drops what is queued and closes every session
        (:meth:`JobRunner.shutdown`), then the sockets close."""
        assert self._socket is not None
        runner.shutdown()
        self._socket.close()
        if self._lane is not None:
            self._lane.close(0 if self._silenced.is_set() else REPLY_LINGER_MS)
