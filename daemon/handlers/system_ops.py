"""System ops, answered by the front: closing another session (``cuctx kill``) and shutting the daemon down.

The daemon's own user (the uid it runs as) administers it: it may close any session and shut the daemon
down; a session's own user may close that session. The uid is the one the kernel gave for the connection
that sent ``hello`` (ipc://); a session whose uid is unknown (tcp://) may do neither.
"""

from __future__ import annotations

import os

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.registry import front_handler
from cuctxd.daemon.handlers.replies import FanOut, Reply
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.daemon.registry.sessions import Session, SessionRef
from cuctxd.protos import system_ops as ops
from cuctxd.protos.errors import NotFound, NotOwner


def who(ref: SessionRef) -> str:
    """``session 7 (cuctx, pid 123, uid 1000)``: a session as the log and an error message name it."""
    uid = "uid unknown" if ref.uid is None else f"uid {ref.uid}"
    return f"session {ref.public_id} ({ref.client or 'unnamed'}, pid {ref.pid}, {uid})"


def is_admin(ref: SessionRef) -> bool:
    """Whether the session runs as the daemon's own user."""
    return ref.uid is not None and ref.uid == os.geteuid()


@front_handler(ops.CloseSession)
def close_session(front: DaemonState, session: Session | None, args: ops.CloseSession, peer: str | None) -> FanOut:
    assert session is not None
    target = front.sessions.by_public_id(args.session_id)
    if target is None:
        raise NotFound(f"no open session {args.session_id} (cuctx status lists them)")
    caller, ref = session.ref, target.ref
    if not (is_admin(caller) or caller.token == ref.token or (caller.uid is not None and caller.uid == ref.uid)):
        raise NotOwner(f"session {ref.public_id} runs as {'an unknown uid' if ref.uid is None else f'uid {ref.uid}'};"
                       f" only that user or the daemon's own user (uid {os.geteuid()}) may close it")
    closed_by = None if caller.token == ref.token else who(caller)
    front.sessions.close(ref.token, closed_by=closed_by)

    def close_on_device(state: DeviceState) -> None:
        state.close_session(ref)

    return FanOut(close_on_device, lambda parts: Reply(), after=target)


@front_handler(ops.Shutdown)
def shutdown(front: DaemonState, session: Session | None, args: ops.Shutdown, peer: str | None) -> Reply:
    assert session is not None
    if not is_admin(session.ref):
        raise NotOwner(f"only the daemon's own user (uid {os.geteuid()}) may shut it down; this session runs as "
                       f"{'an unknown uid (tcp://)' if session.ref.uid is None else f'uid {session.ref.uid}'}")
    if front.request_stop is None:
        raise NotOwner("this daemon takes no shutdown request; stop it with SIGTERM")
    front.request_stop(who(session.ref))
    return Reply()
