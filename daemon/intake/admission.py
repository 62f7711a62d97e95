"""Admitting a request: decode, check and resolve it, on whichever thread received it.

Requests arrive on the front's ROUTER (every op) and on each device worker's own
ROUTER (device ops only, see ``protos/PROTOCOL.md``, "Device endpoints"). Both
run the same checks, in the order the spec gives: header, op and arguments,
session, payload, device; and both answer a refused request the same way
(:func:`refusal`). The session registry is the front's; a lane reads it and
writes only what :class:`~cuctxd.daemon.registry.sessions.Session` allows it
(its own ``seen`` slot, and ``current_device`` for a ``set_device`` it runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.daemon.registry.sessions import Session
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import (
    BadRequest,
    CuctxError,
    CudaError,
    DeviceNotAllowed,
    InternalError,
    SessionClosed,
    SessionExpired,
    ShuttingDown,
    TooLarge,
    UnknownSession,
)
from cuctxd.protos.messages import RequestHeader, request_id_of
from cuctxd.protos.schema import OpSpec, decode_args

log = logging.getLogger(__name__)

#: The front's receiver slot in :attr:`Session.seen`; device N's lane has ``1 + N``.
FRONT_RECEIVER = 0


class Admitted(NamedTuple):
    """A request that passed every check: its header, session (None for sessionless ops), arguments."""

    request: RequestHeader
    session: Session | None
    args: Any


def admit(state: DaemonState, request: RequestHeader, payload: Sequence[Any], receiver: int) -> Admitted:
    """Check a parsed request against the daemon's state; raises the error to reply with.

    ``receiver``: the slot of :attr:`Session.seen` the calling thread owns.
    """
    if state.draining:
        raise ShuttingDown("cuctxd is shutting down and takes no new requests; retry once it is back")
    spec = request.spec
    session = _session_of(state, request, receiver)
    _check_payload(state, spec, payload)
    return Admitted(request, session, decode_args(spec, request.args))


def device_job(admitted: Admitted, identity: bytes, payload: Sequence[Any], device_count: int,
               received: float, lane: int | None = None, shm: Any = None) -> Job:
    """The job for an admitted device op, on the device it runs on: its ``device`` argument, else the
    session's current device.

    Raises ``CUDA_ERROR_INVALID_DEVICE`` when it, or ``dst_device``, is not below
    ``device_count``, ``CUCTXD_ERROR_DEVICE_NOT_ALLOWED`` when it is not one of the session's
    (``gpu_limit``), and, on device ``lane``'s endpoint, ``CUCTXD_ERROR_BAD_REQUEST``
    when it is another device. A ``set_device`` makes its device current here, on receipt.
    """
    request, session, args = admitted
    assert session is not None
    spec = request.spec
    device: int = session.current_device if args.device is None else args.device
    for named in (device, getattr(args, "dst_device", None)):
        if named is not None and named >= device_count:
            raise CudaError.of(
                CUresult.CUDA_ERROR_INVALID_DEVICE,
                f"device {named}; this daemon serves {device_count} device(s)",
            )
    _check_allowed(session, device, getattr(args, "dst_device", None))
    if lane is not None and device != lane:
        raise BadRequest(f"{spec.name} is for device {device} but came to device {lane}'s endpoint: "
                         f"send it to device {device}'s endpoint or the main one")
    if spec.name == "set_device":  # cudaSetDevice changes the session's current device
        session.current_device = device
    backlog = session.backlogs[device] if device < len(session.backlogs) else None
    return Job(identity, request.id, spec, args, session.ref, device, payload, lane, received, backlog, shm)


def _check_allowed(session: Session, *devices: int | None) -> None:
    """``gpu_limit``: DeviceNotAllowed for a device that is not one of the session's pod's GPUs."""
    allowed = session.ref.devices
    for device in devices:
        if allowed is not None and device is not None and device not in allowed:
            raise DeviceNotAllowed(f"gpu_limit: device {device} is not one of this pod's GPUs (it may use "
                                   f"{', '.join(map(str, sorted(allowed))) or 'none'})")


def refusal(header: Any, op_name: str, exc: Exception, where: str = "") -> tuple[int, CuctxError]:
    """The request id and error to answer a request that failed with ``exc`` (``where``: " on device
    N's endpoint", for the log). A :class:`CuctxError` is answered as it is (logged at DEBUG); anything
    else is a bug, logged with its traceback and answered as an internal error."""
    request_id = request_id_of(header)  # only failures need it from a header that may be garbage
    if isinstance(exc, CuctxError):
        log.debug("request %d (%s)%s failed: %s", request_id, op_name, where, exc)
        return request_id, exc
    log.exception("internal error handling request %d (%s)%s", request_id, op_name, where)
    return request_id, InternalError(f"unexpected failure in {op_name}; see the daemon log")


def _session_of(state: DaemonState, request: RequestHeader, receiver: int) -> Session | None:
    if not request.spec.needs_session:
        return None
    if request.session is None:
        raise UnknownSession(f"{request.spec.name} needs a session: send hello first")
    session = state.sessions.get(request.session)
    if session is None:
        closed_by = state.sessions.closed_by(request.session)
        if closed_by is not None:
            raise SessionClosed(f"this session was closed by {closed_by}")
        if state.sessions.was_expired(request.session):
            raise SessionExpired(
                f"the session's lease ran out ({state.config.lease_ttl:g} s without a request "
                "or heartbeat) and the daemon freed its contexts and memory; open a new session"
            )
        raise UnknownSession("unknown or closed session; open a new one with hello")
    session.seen[receiver] = time.monotonic()
    return session


def _check_payload(state: DaemonState, spec: OpSpec, payload: Sequence[Any]) -> None:
    expected = 1 if spec.payload_in else 0
    if len(payload) != expected:
        raise BadRequest(f"{spec.name} takes {expected} payload frame(s), got {len(payload)}")
    for frame in payload:
        if len(frame) > state.config.max_payload:
            raise TooLarge(
                f"payload of {len(frame)} bytes exceeds the limit of {state.config.max_payload}"
            )
