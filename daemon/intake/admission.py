"""Admitting a request: decode, check and resolve it, on whichever thread received it.

Requests arrive on the front's ROUTER (every op) and on each device worker's own
ROUTER (device ops only, see ``protos/PROTOCOL.md``, "Device endpoints"). Both
run the same checks, in the order the spec gives: header, op and arguments,
session, payload, device. The session registry is the front's; a worker only
reads it (dict lookups are atomic under the GIL) and stamps ``last_seen`` and,
for ``set_device``, ``current_device``, as the front does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from cuctxd.daemon.front.state import FrontState
from cuctxd.daemon.registry.sessions import Session
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import BadRequest, CudaError, SessionExpired, ShuttingDown, TooLarge, UnknownSession
from cuctxd.protos.messages import RequestHeader
from cuctxd.protos.schema import OpSpec, decode_args


class Admitted(NamedTuple):
    """A request that passed every check: its header, session (None for sessionless ops), arguments."""

    request: RequestHeader
    session: Session | None
    args: Any


def admit(state: FrontState, request: RequestHeader, payload: Sequence[Any]) -> Admitted:
    """Check a parsed request against the daemon's state; raises the error to reply with."""
    if state.draining:
        raise ShuttingDown("cuctxd is shutting down and takes no new requests; retry once it is back")
    spec = request.spec
    session = _session_of(state, request)
    _check_payload(state, spec, payload)
    return Admitted(request, session, decode_args(spec, request.args))


def device_of(spec: OpSpec, session: Session, args: Any, device_count: int) -> int:
    """The device a device op runs on: its ``device`` argument, else the session's current device.

    Raises ``CUDA_ERROR_INVALID_DEVICE`` when it, or ``dst_device``, is not below
    ``device_count``. A ``set_device`` makes its device current here, on receipt.
    """
    device: int = session.current_device if args.device is None else args.device
    for named in (device, getattr(args, "dst_device", None)):
        if named is not None and named >= device_count:
            raise CudaError.of(
                CUresult.CUDA_ERROR_INVALID_DEVICE,
                f"device {named}; this daemon serves {device_count} device(s)",
            )
    if spec.name == "set_device":  # cudaSetDevice changes the session's current device
        session.current_device = device
    return device


def _session_of(state: FrontState, request: RequestHeader) -> Session | None:
    if not request.spec.needs_session:
        return None
    if request.session is None:
        raise UnknownSession(f"{request.spec.name} needs a session: send hello first")
    session = state.sessions.get(request.session)
    if session is None:
        if state.sessions.was_expired(request.session):
            raise SessionExpired(
                f"the session's lease ran out ({state.config.lease_ttl:g} s without a request "
                "or heartbeat) and the daemon freed its contexts and memory; open a new session"
            )
        raise UnknownSession("unknown or closed session; open a new one with hello")
    session.last_seen = time.monotonic()
    return session


def _check_payload(state: FrontState, spec: OpSpec, payload: Sequence[Any]) -> None:
    expected = 1 if spec.payload_in else 0
    if len(payload) != expected:
        raise BadRequest(f"{spec.name} takes {expected} payload frame(s), got {len(payload)}")
    for frame in payload:
        if len(frame) > state.config.max_payload:
            raise TooLarge(
                f"payload of {len(frame)} bytes exceeds the limit of {state.config.max_payload}"
            )
