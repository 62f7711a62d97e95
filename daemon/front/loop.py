"""The front thread: owns the client-facing ROUTER socket(s), decodes, validates, routes.

Requests enter here (:meth:`Front.serve`), are decoded and checked against
``protos`` (:meth:`Front._handle`), and either answered on this thread (front
ops) or queued to the device's worker as a :class:`~cuctxd.daemon.intake.jobs.Job`. Workers
send their replies over inproc to the PULL socket polled here, and they leave
through the ROUTER. A front op that must wait on a service outside the daemon (``gpu_limit``'s
lookups at ``hello``) is answered once the lookup pool (:mod:`cuctxd.daemon.front.lookups`) rings.
(Device ops a client sends to a device's own endpoint never pass here: :mod:`cuctxd.daemon.worker.lane`.)
Garbage gets an error reply, or is dropped and logged when it cannot even be addressed;
nothing a client sends can stop this loop.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import zmq

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.front.lookups import LookupPool, Waiting
from cuctxd.daemon.handlers import FRONT_HANDLERS
from cuctxd.daemon.handlers.replies import Deferred, FanOut, Forward, Gather, Reply
from cuctxd.daemon.intake.admission import FRONT_RECEIVER, Admitted, admit, device_job, refusal
from cuctxd.daemon.intake.jobs import Job, payload_bytes
from cuctxd.daemon.intake.observe import RequestObserver
from cuctxd.daemon.intake.peers import peer_of
from cuctxd.daemon.intake.router_io import readable, recv_batch, send_parts, send_reply
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.daemon.worker.loop import DeviceWorker
from cuctxd.daemon.worker.queues import check_sent
from cuctxd.protos.errors import ShuttingDown
from cuctxd.protos.messages import encode_error, encode_result, parse_request, unpack

log = logging.getLogger(__name__)


class Front:
    """Runs on one thread (the caller of :meth:`serve`) and owns every socket it creates."""

    #: Told about every request handled and every worker reply forwarded (logs, metrics); optional.
    observer: RequestObserver | None = None
    #: Runs the lookups a front op waits on (``gpu_limit``); set by the daemon where there are any.
    lookups: LookupPool | None = None

    def __init__(
        self,
        state: DaemonState,
        workers: Sequence[DeviceWorker],
        router: zmq.Socket[Any],
        replies: zmq.Socket[Any],
    ) -> None:
        self.state = state
        self.workers = workers
        self.router = router
        self.replies = replies

    def serve(self, stop_fd: int) -> None:
        """Serve until ``stop_fd`` becomes readable; reap expired sessions as time passes."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        poller.register(stop_fd, zmq.POLLIN)
        doorbell = self.lookups.doorbell if self.lookups is not None else None
        if doorbell is not None:
            poller.register(doorbell, zmq.POLLIN)
        ttl = self.state.config.lease_ttl
        reap_every = min(1.0, ttl / 4)
        next_reap = time.monotonic() + reap_every
        router, replies = self.router, self.replies
        while True:
            for ready, _ in poller.poll(max(1, int((next_reap - time.monotonic()) * 1000))):
                if ready is replies:
                    self._forward_replies()
                elif ready is router:
                    self._take_requests()
                elif ready == doorbell:
                    self._answer_looked_up()
                else:
                    return  # the stop pipe
            now = time.monotonic()
            if now >= next_reap:
                self._reap(now, ttl)
                if self.observer is not None:
                    self.observer.report_held_back()
                orphan_ttl = self.state.config.orphan_ttl
                for worker in self.workers:
                    worker.run(partial(_expire, now=now, ttl=orphan_ttl))
                next_reap = now + reap_every

    def _reap(self, now: float, ttl: float) -> None:
        """End the sessions past their lease; none while draining, when every heartbeat is refused (a client
        cannot renew its lease, and the processes of its sessions still map what they hold open)."""
        if self.state.draining:
            return
        reaped = self.state.sessions.expire(now, ttl)
        for session in reaped:
            self.state.sessions_reaped += 1
            ref = session.ref
            log.info("session %d (%s, pid %d) reaped: no request or heartbeat for %.1f s",
                     ref.public_id, ref.client, ref.pid, ttl)
            for worker in self.workers:
                worker.close_session(session)
        if reaped:
            _trim_heap()

    def _forward_replies(self) -> None:
        replies = self.replies
        while readable(replies):
            self._forward_one()

    def flush_replies(self, wait_ms: int) -> None:
        """Forward worker replies until none has come for ``wait_ms``: at shutdown, what the workers
        answered while stopping (synchronizes in flight, late continuations)."""
        while self.replies.poll(wait_ms, zmq.POLLIN):
            self._forward_one()

    def _forward_one(self) -> None:
        """Pass one worker reply ``[identity, header, *payload]`` on to its client (never blocks)."""
        frames = self.replies.recv_multipart(copy=False)
        if self.observer is not None:
            self.observer.replied(frames)
        send_reply(self.router, frames, copy=False)

    def _take_requests(self) -> None:
        """The poller said a request is waiting: take it, and those behind it, up to a batch."""
        for message in recv_batch(self.router):
            self._handle(*message)

    def _handle(self, identity: bytes, header_bytes: bytes, payload: Sequence[zmq.Frame],
                header_frame: zmq.Frame | None = None) -> None:
        """Admit a request and answer it (front op, or refusal) or queue it to its device's worker.

        ``header_frame``: its properties say who sent it (:mod:`cuctxd.daemon.intake.peers`), which
        only ``hello`` asks (two property reads, not worth paying on every request).
        """
        header: Any = None
        op_name = "?"
        outcome = "ok"
        started = time.perf_counter()
        try:
            header = unpack(header_bytes)
            request = parse_request(header)
            request_id, op_name = request.id, request.spec.name
            admitted = admit(self.state, request, payload, FRONT_RECEIVER)
            if request.spec.target == "front":
                peer = peer_of(header_frame) if header_frame is not None and op_name == "hello" else None
                if not self._answer(identity, admitted, peer, started):
                    return  # answered once its lookup is done, and observed then
            else:
                job = device_job(admitted, identity, payload, len(self.workers), started)
                if job.backlog is not None:
                    check_sent(job.backlog, payload_bytes(job), self.state.config.queue_limits)
                self.workers[job.device].submit(job)
        except Exception as exc:
            request_id, error = refusal(header, op_name, exc)
            outcome = error.name
            send_parts(self.router, identity, encode_error(request_id, error))
        if self.observer is not None:
            self.observer.handled(identity, request_id, op_name, outcome, started)

    def _answer(self, identity: bytes, admitted: Admitted, peer: str | None, started: float) -> bool:
        """Run a front op here and reply (a fan-out replies from the last worker to finish, a forward from the
        worker it goes to); False when it waits on a lookup (:meth:`_answer_looked_up` replies)."""
        request = admitted.request
        outcome = FRONT_HANDLERS[request.spec.name](self.state, admitted.session, admitted.args, peer)
        if isinstance(outcome, FanOut):
            self._fan_out(identity, request.id, outcome)
        elif isinstance(outcome, Forward):  # the device's worker replies, through the replies socket
            assert admitted.session is not None
            job = Job(identity, request.id, request.spec, admitted.args, admitted.session.ref, outcome.device)
            self.workers[outcome.device].forward(job, outcome)
        elif isinstance(outcome, Deferred):
            assert self.lookups is not None, "a handler deferred its reply, and the daemon runs no lookup pool"
            self.lookups.submit(outcome, Waiting(identity, request.id, request.spec.name, outcome.then, started))
            return False
        else:
            assert isinstance(outcome, Reply)
            send_parts(self.router, identity, encode_result(request.id, outcome.result), outcome.frames)
        return True

    def _answer_looked_up(self) -> None:
        """The lookup pool rang: answer each request whose lookup is done (unless the daemon began to drain
        meanwhile, and takes no new session)."""
        assert self.lookups is not None
        for looked in self.lookups.finished():
            for waiting in looked.waiting:
                outcome = "ok"
                try:
                    if looked.error is not None:
                        raise looked.error
                    if self.state.draining:
                        raise ShuttingDown("cuctxd is shutting down and takes no new requests; retry once it is back")
                    reply = waiting.then(looked.result)
                    send_parts(self.router, waiting.identity, encode_result(waiting.request_id, reply.result),
                               reply.frames)
                except Exception as exc:
                    request_id, error = refusal({"id": waiting.request_id}, waiting.op, exc)
                    outcome = error.name
                    send_parts(self.router, waiting.identity, encode_error(request_id, error))
                if self.observer is not None:
                    self.observer.handled(waiting.identity, waiting.request_id, waiting.op, outcome, waiting.started)

    def _fan_out(self, identity: bytes, request_id: int, fan_out: FanOut) -> None:
        if not self.workers:
            reply = fan_out.finish([])
            send_parts(self.router, identity, encode_result(request_id, reply.result))
            return
        gather = Gather(fan_out, len(self.workers))
        for worker in self.workers:
            worker.fan_out(identity, request_id, gather, fan_out)


def _expire(state: DeviceState, now: float, ttl: float) -> None:
    """Free the orphans past ``ttl``, unregister the host buffers and release the primary context kept past
    ``primary_keep`` (the buffers first: they are registered in it)."""
    state.sharing.expire_orphans(now, ttl)
    state.host.kept.release(now)
    state.contexts.release_kept(now)


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return cast("Callable[[int], int]", ctypes.CDLL(None).malloc_trim)
    except (AttributeError, OSError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give freed heap memory back to the system once sessions have been reaped: glibc keeps the
    memory of freed mid-sized blocks (a vanished client's unread replies of 1 MiB, say) otherwise.
    Costs milliseconds when there is much to give back, so only after a reap."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
