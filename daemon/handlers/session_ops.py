"""Ops the front thread answers itself: handshake, session end, queries, status."""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

from cuctxd.daemon import __version__
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.status import device_status, first, fit_status
from cuctxd.daemon.handlers.registry import front_handler
from cuctxd.daemon.handlers.replies import Deferred, FanOut, Reply
from cuctxd.daemon.intake.peers import peer_or_pid, pid_of, uid_of
from cuctxd.daemon.registry.backlogs import backlog_status
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.daemon.registry.fd_budget import fd_peer
from cuctxd.daemon.registry.sessions import Session
from cuctxd.protos import ops
from cuctxd.protos.errors import LimitExceeded, VersionMismatch
from cuctxd.protos.host import host_identity
from cuctxd.protos.limits import MAX_HEADER_BYTES, MAX_PAYLOAD_FRAMES
from cuctxd.protos.version import PROTOCOL_VERSION


@front_handler(ops.Hello)
def hello(front: DaemonState, session: Session | None, args: ops.Hello, peer: str | None) -> Reply | Deferred:
    """Under ``gpu_limit`` a pod's first hello waits for its lookup (:class:`Deferred`), off the front thread."""
    if args.protocol != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"client speaks protocol {args.protocol}, this daemon speaks {PROTOCOL_VERSION}"
        )
    uid, pid = uid_of(peer), pid_of(peer)
    peer = peer_or_pid(peer, args.pid)
    _check_session_limits(front, peer, uid)
    devices = front.device_limit(pid) if front.device_limit is not None else None
    if devices is None or isinstance(devices, frozenset):
        return _open(front, args, peer, uid, pid, devices)
    return Deferred(devices.key, devices, partial(_open, front, args, peer, uid, pid))


def _check_session_limits(front: DaemonState, peer: str, uid: int | None) -> None:
    limit = front.config.max_sessions_per_peer
    if limit and front.sessions.count_peer(peer) >= limit:
        raise LimitExceeded(f"max_sessions_per_peer: {peer} already holds {limit} open session(s); "
                            "close one (or let its lease run out) first")
    limit = front.config.max_sessions_per_uid
    if limit and uid is not None and front.sessions.count_uid(uid) >= limit:
        raise LimitExceeded(f"max_sessions_per_uid: the processes of uid {uid} already hold {limit} open "
                            "session(s) together; close one (or let its lease run out) first")


def _open(front: DaemonState, args: ops.Hello, peer: str, uid: int | None, pid: int | None,
          devices: frozenset[int] | None) -> Reply:
    """Open the session (front thread; after a lookup, the limits are checked again: others may have opened)."""
    _check_session_limits(front, peer, uid)
    opened = front.sessions.open(args.client, args.pid, peer, uid, fd_peer(uid, pid, peer), devices)
    return Reply({
        "session": opened.ref.token,
        "session_id": opened.ref.public_id,
        "daemon_version": __version__,
        "instance": front.instance,
        "protocol": PROTOCOL_VERSION,
        "backend": front.backend,
        "devices": [d.to_wire() for d in front.devices],
        "allowed_devices": _allowed(devices),
        "lease_ttl": front.config.lease_ttl,
        "endpoints": front.endpoints,
        "device_endpoints": front.device_endpoints,
        "fd_channel": front.fd_channel.paths[0] if front.fd_channel is not None else None,
        "host": host_identity(),
        "limits": {
            "max_header_bytes": MAX_HEADER_BYTES,
            "max_payload_bytes": front.config.max_payload,
            "max_payload_frames": MAX_PAYLOAD_FRAMES,
        },
    })


def _allowed(devices: frozenset[int] | None) -> list[int] | None:
    """``allowed_devices``: the indices of the devices the session may use (``gpu_limit``), None for all."""
    return None if devices is None else sorted(devices)


@front_handler(ops.Goodbye)
def goodbye(front: DaemonState, session: Session | None, args: ops.Goodbye, peer: str | None) -> FanOut:
    assert session is not None
    front.sessions.close(session.ref.token)
    ref = session.ref

    def close_on_device(state: DeviceState) -> None:
        state.close_session(ref)

    return FanOut(close_on_device, lambda parts: Reply(), after=session)


@front_handler(ops.Ping)
def ping(front: DaemonState, session: Session | None, args: ops.Ping, peer: str | None) -> Reply:
    """Answers with this daemon run's ``instance``: a client whose reply is late asks it, so as to tell a
    restarted daemon from a slow one."""
    return Reply({"instance": front.instance})


@front_handler(ops.DeviceCount)
def device_count(front: DaemonState, session: Session | None, args: ops.DeviceCount, peer: str | None) -> Reply:
    assert session is not None
    return Reply({"count": len(front.devices), "allowed_devices": _allowed(session.ref.devices)})


@front_handler(ops.Devices)
def devices(front: DaemonState, session: Session | None, args: ops.Devices, peer: str | None) -> Reply:
    assert session is not None
    return Reply({"devices": [d.to_wire() for d in front.devices], "allowed_devices": _allowed(session.ref.devices)})


@front_handler(ops.GetDevice)
def get_device(front: DaemonState, session: Session | None, args: ops.GetDevice, peer: str | None) -> Reply:
    assert session is not None
    return Reply({"device": session.current_device})


@front_handler(ops.Status)
def status(front: DaemonState, session: Session | None, args: ops.Status, peer: str | None) -> FanOut:
    """Each device adds its ``queues``: the queued requests and untaken reply bytes there of every session
    with any, read on its worker (which owns those counts), against ``limits``."""
    sessions = front.sessions.all()
    limits = front.config.queue_limits
    daemon_part: dict[str, Any] = {
        "daemon_version": __version__,
        "protocol": PROTOCOL_VERSION,
        "backend": front.backend,
        "pid": os.getpid(),
        "node": front.config.node_name,
        "uptime_s": time.time() - front.started_at,
        "ready": front.ready,
        "endpoints": list(front.config.endpoints),
        "sessions": [s.to_status() for s in first(sessions)],
        "session_count": len(sessions),
        "device_ordinals": list(front.config.device_ordinals),
        "limits": {
            "max_queued_requests": limits.max_queued_requests,
            "max_queued_bytes": limits.max_queued_bytes,
            "max_reply_bytes": limits.max_reply_bytes,
            "max_reply_bytes_per_peer": limits.max_reply_bytes_per_peer,
            "max_manifest_bytes_per_session": front.shares.limits.max_manifest_bytes_per_session,
            "max_manifest_bytes_per_uid": front.shares.limits.max_manifest_bytes_per_uid,
            "max_names_per_uid": front.shares.limits.max_names_per_uid,
        },
        "names": front.shares.names_status(),
    }
    if front.connections is not None:
        daemon_part["connections"] = front.connections.to_status()
    if front.fd_channel is not None:
        daemon_part["fd_channel"] = front.fd_channel.stats()
    if front.fd_budget is not None:
        daemon_part["fd_budget"] = front.fd_budget.to_status()
    if front.shares.parking is not None:
        daemon_part["parking"] = front.shares.parking.to_status()
    if front.lookup_status is not None:
        daemon_part["pod_lookups"] = front.lookup_status()

    def each(state: DeviceState) -> dict[str, Any]:
        part = device_status(state)
        queues = ({"session": s.ref.public_id, **backlog_status(s.backlogs[state.device])}
                  for s in sessions if state.device < len(s.backlogs))
        part["queues"] = first(q for q in queues if q["queued"] or q["reply_bytes"])
        return part

    def finish(parts: list[Any]) -> Reply:
        truncated = daemon_part["session_count"] > len(daemon_part["sessions"]) or any(
            part.get("truncated", False) for part in parts)
        return Reply(fit_status({**daemon_part, "devices": parts, "truncated": truncated}))

    return FanOut(each, finish)
