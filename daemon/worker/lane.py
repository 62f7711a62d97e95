"""A device's own ROUTER: device ops that clients send straight to the worker that runs them.

Through the front, a device op crosses two threads (front -> worker -> front),
and each hand-off under the GIL costs tens of microseconds. A client that was
told the device endpoints in ``hello`` sends device ops for device N to device
N's endpoint instead; its worker thread receives, admits (:mod:`cuctxd.daemon.intake.admission`,
the same checks as the front), queues (:mod:`cuctxd.daemon.worker.queues`, whose limits
refuse it here like any other check), runs and answers each one itself. Front ops and
requests for another device are refused here with ``CUCTXD_ERROR_BAD_REQUEST``
rather than passed on, so a session's requests for one device always arrive
through one socket, in order. Owned by its worker thread, like the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cuctxd.daemon.intake.admission import admit, device_job, refusal
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.intake.observe import RequestObserver
from cuctxd.daemon.intake.router_io import recv_batch, send_parts
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.protos.errors import BadRequest, CuctxError
from cuctxd.protos.messages import encode_error, parse_request, unpack


class DeviceLane:
    """Device ``device``'s ROUTER, with the daemon-wide state to admit requests against (read, but for
    what :class:`~cuctxd.daemon.registry.sessions.Session` lets a lane write)."""

    def __init__(self, device: int, router: zmq.Socket[Any], state: DaemonState,
                 observer: RequestObserver | None) -> None:
        self.device = device
        self.router = router
        self.state = state
        self.observer = observer
        #: This lane's slot in each session's ``seen`` (the front has slot 0).
        self.receiver = 1 + device
        self.where = f" on device {device}'s endpoint"

    def take_requests(self, queue: Callable[[Job], None]) -> None:
        """A request is waiting: admit it, and those behind it up to a batch, handing each to ``queue``
        (which raises the error to refuse it with, e.g. a queue limit)."""
        for identity, header, payload, _ in recv_batch(self.router):
            self._admit(identity, header, payload, queue)

    def _admit(self, identity: bytes, header_bytes: bytes, payload: Sequence[zmq.Frame],
               queue: Callable[[Job], None]) -> None:
        """Admit the request and queue it as a job, or answer it with its error."""
        received = time.perf_counter()
        refused = self.admit(identity, header_bytes, payload, queue, received)
        if refused is not None:
            request_id, op_name, error = refused
            self.reply(identity, request_id, op_name, encode_error(request_id, error), (), error.name, received)

    def admit(self, identity: bytes, header_bytes: bytes, payload: Sequence[Any], queue: Callable[[Job], None],
              received: float, shm: Any = None) -> tuple[int, str, CuctxError] | None:
        """Admit a request that came here or through ``shm`` (a session's shm lane to this device) and queue it
        as a job; or ``(request id, op, error)`` to answer it with."""
        header: Any = None
        op_name = "?"
        try:
            header = unpack(header_bytes)
            request = parse_request(header)
            op_name = request.spec.name
            if request.spec.target != "device":
                raise BadRequest(f"{op_name} is not a device op: send it to the daemon's main endpoint, "
                                 f"not to device {self.device}'s")
            admitted = admit(self.state, request, payload, self.receiver)
            if shm is not None and (admitted.session is None or admitted.session.ref.token != shm.session.token):
                raise BadRequest("a request on an shm lane must be of the session the lane was opened for")
            queue(device_job(admitted, identity, payload, len(self.state.devices), received, self.device, shm))
            return None
        except Exception as exc:
            request_id, error = refusal(header, op_name, exc, self.where)
            return request_id, op_name, error

    def reply(self, identity: bytes, request_id: int, op: str, header: bytes, payload: Sequence[Any],
              outcome: str, received: float, track: bool = False) -> list[tuple[Any, int]]:
        """Answer a request that came in here; the observer hears of it as the front's requests.
        ``track``: return the payload frames' trackers (:func:`~cuctxd.daemon.intake.router_io.send_parts`)."""
        trackers = send_parts(self.router, identity, header, payload, track=track)
        self.finished(op, outcome, received, request_id)
        return trackers

    def finished(self, op: str, outcome: str, received: float, request_id: int) -> None:
        """Tell the observer a request that came here, or through an shm lane, was answered."""
        if self.observer is not None:
            self.observer.finished(op, outcome, received, request_id)

    def close(self, linger_ms: int = 0) -> None:
        """``linger_ms``: how long the context's termination may wait for replies still queued here (a
        slow reader's, after a drain)."""
        self.router.setsockopt(zmq.LINGER, linger_ms)
        self.router.close()
