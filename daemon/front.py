"""The front thread: owns the client-facing ROUTER socket(s), decodes, validates, routes.

Requests enter here (:meth:`Front.serve`), are decoded and checked against
``protos`` (:meth:`Front._handle`), and either answered on this thread (front
ops) or queued to the device's worker as a :class:`~daemon.jobs.Job`. Workers
send their replies over inproc to the PULL socket polled here, and they leave
through the ROUTER. Garbage gets an error reply, or is dropped and logged when
it cannot even be addressed; nothing a client sends can stop this loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import zmq

from daemon.device_state import DeviceState
from daemon.front_state import FrontState
from daemon.handlers import FRONT_HANDLERS
from daemon.jobs import Job
from daemon.observe import RequestObserver
from daemon.peers import peer_of
from daemon.replies import FanOut, Gather, Reply
from daemon.sessions import Session
from daemon.worker import DeviceWorker
from protos.cuda_results import CUresult
from protos.errors import (
    BadRequest,
    CuctxError,
    CudaError,
    InternalError,
    SessionExpired,
    ShuttingDown,
    TooLarge,
    UnknownSession,
)
from protos.messages import RequestHeader, encode_error, encode_result, parse_request, request_id_of, unpack
from protos.schema import OpSpec, decode_args

log = logging.getLogger(__name__)

#: Requests taken off the ROUTER per poll wake-up before replies get a turn.
_BATCH = 64


# Plain ints: pyzmq's flag enums cost a Python-level enum operation on every use.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _readable(socket: zmq.Socket[Any]) -> bool:
    """A message is waiting (checking EVENTS is far cheaper than a NOBLOCK recv raising Again)."""
    return bool(cast(int, socket.getsockopt(_EVENTS)) & _POLLIN)


class Front:
    """Runs on one thread (the caller of :meth:`serve`) and owns every socket it creates."""

    #: Told about every request handled and every worker reply forwarded (logs, metrics); optional.
    observer: RequestObserver | None = None

    def __init__(
        self,
        state: FrontState,
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
                else:
                    return  # the stop pipe
            now = time.monotonic()
            if now >= next_reap:
                self._reap(now, ttl)
                orphan_ttl = self.state.config.orphan_ttl
                for worker in self.workers:
                    worker.run(partial(DeviceState.expire_orphans, now=now, ttl=orphan_ttl))
                next_reap = now + reap_every

    def _reap(self, now: float, ttl: float) -> None:
        for session in self.state.sessions.expire(now, ttl):
            self.state.sessions_reaped += 1
            ref = session.ref
            log.info("session %d (%s, pid %d) reaped: no request or heartbeat for %.1f s",
                     ref.public_id, ref.client, ref.pid, ttl)
            for worker in self.workers:
                worker.run(partial(DeviceState.close_session, ref=ref))

    def _forward_replies(self) -> None:
        replies = self.replies
        while _readable(replies):
            frames = replies.recv_multipart(copy=False)
            if self.observer is not None:
                self.observer.replied(frames)
            self._send(frames, copy=False)

    def _take_requests(self) -> None:
        router = self.router
        for _ in range(_BATCH):
            # Identity and header are small: plain bytes are cheaper than Frames. Payload
            # frames stay zero-copy all the way to the driver call.
            if not _readable(router):
                return
            identity = router.recv()
            if not router.getsockopt(_RCVMORE):
                log.warning("dropped a message of 1 frame: no header to answer")
                continue
            peer = None
            if self.state.config.max_sessions_per_peer:  # a Frame, to read who sent it (daemon.peers)
                header_frame = router.recv(copy=False)
                header, peer = header_frame.bytes, peer_of(header_frame)
            else:
                header = router.recv()
            payload = []
            while router.getsockopt(_RCVMORE):
                payload.append(router.recv(copy=False))
            self._handle(identity, header, payload, peer)

    def _handle(self, identity: bytes, header_bytes: bytes, payload: Sequence[zmq.Frame],
                peer: str | None = None) -> None:
        request_id = 0
        op_name = "?"
        outcome = "ok"
        started = time.perf_counter() if self.observer is not None else 0.0
        try:
            header = unpack(header_bytes)
            request_id = request_id_of(header)
            request = parse_request(header)
            op_name = request.spec.name
            self.state.requests_served += 1
            self.state.request_peer = peer
            self._dispatch(identity, request, payload)
        except CuctxError as exc:
            outcome = exc.name
            log.debug("request %d (%s) failed: %s", request_id, op_name, exc)
            self._send([identity, encode_error(request_id, exc)])
        except Exception:
            log.exception("internal error handling request %d (%s)", request_id, op_name)
            error = InternalError(f"unexpected failure in {op_name}; see the daemon log")
            outcome = error.name
            self._send([identity, encode_error(request_id, error)])
        if self.observer is not None:
            self.observer.handled(identity, request_id, op_name, outcome, started)

    def _dispatch(self, identity: bytes, request: RequestHeader, payload: Sequence[zmq.Frame]) -> None:
        if self.state.draining:
            raise ShuttingDown("cuctxd is shutting down and takes no new requests; retry once it is back")
        spec = request.spec
        session = self._session_of(request)
        self._check_payload(spec, payload)
        args = decode_args(spec, request.args)
        if spec.target == "front":
            outcome = FRONT_HANDLERS[spec.name](self.state, session, args)
            if isinstance(outcome, FanOut):
                self._fan_out(identity, request.id, outcome)
            else:
                assert isinstance(outcome, Reply)
                self._send([identity, encode_result(request.id, outcome.result), *outcome.frames])
                for task in outcome.tasks:
                    self.workers[task.device].run(task.run)
            return
        assert session is not None
        device = session.current_device if args.device is None else args.device
        for named in (device, getattr(args, "dst_device", None)):
            if named is not None and named >= len(self.workers):
                raise CudaError.of(
                    CUresult.CUDA_ERROR_INVALID_DEVICE,
                    f"device {named}; this daemon serves {len(self.workers)} device(s)",
                )
        if spec.name == "set_device":  # cudaSetDevice changes the session's current device
            session.current_device = device
        job = Job(identity, request.id, spec, args, session.ref, device, payload)
        self.workers[device].submit(job)

    def _session_of(self, request: RequestHeader) -> Session | None:
        if not request.spec.needs_session:
            return None
        if request.session is None:
            raise UnknownSession(f"{request.spec.name} needs a session: send hello first")
        session = self.state.sessions.get(request.session)
        if session is None:
            if self.state.sessions.was_expired(request.session):
                raise SessionExpired(
                    f"the session's lease ran out ({self.state.config.lease_ttl:g} s without a request "
                    "or heartbeat) and the daemon freed its contexts and memory; open a new session"
                )
            raise UnknownSession("unknown or closed session; open a new one with hello")
        session.last_seen = time.monotonic()
        return session

    def _check_payload(self, spec: OpSpec, payload: Sequence[zmq.Frame]) -> None:
        expected = 1 if spec.payload_in else 0
        if len(payload) != expected:
            raise BadRequest(f"{spec.name} takes {expected} payload frame(s), got {len(payload)}")
        for frame in payload:
            if len(frame) > self.state.config.max_payload:
                raise TooLarge(
                    f"payload of {len(frame)} bytes exceeds the limit of {self.state.config.max_payload}"
                )

    def _fan_out(self, identity: bytes, request_id: int, fan_out: FanOut) -> None:
        if not self.workers:
            reply = fan_out.finish([])
            self._send([identity, encode_result(request_id, reply.result)])
            return
        gather = Gather(fan_out, len(self.workers))
        for worker in self.workers:
            worker.fan_out(identity, request_id, gather, fan_out)

    def _send(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        router, last = self.router, len(frames) - 1
        try:
            for index, frame in enumerate(frames):
                router.send(frame, _NOBLOCK_MORE if index < last else _NOBLOCK, copy=copy)
        except zmq.Again:
            log.warning("dropped a reply: the client is not reading (send queue full)")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("dropped a reply to a client that has gone away")
