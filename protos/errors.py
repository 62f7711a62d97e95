"""The one exception hierarchy shared by daemon and client, and its wire mapping.

Every failure a client can see is a :class:`CuctxError`. CUDA driver failures
are :class:`CudaError` and keep CUDA's own ``CUresult`` value and name; the
daemon's own failures are :class:`DaemonError` subclasses with codes from
:class:`ErrorCode`. :func:`error_to_wire` and :func:`error_from_wire` are the
only places where exceptions and wire error maps are converted.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from cuctxd.protos.cuda_results import DRIVER_MESSAGES, CUresult


class ErrorCode(IntEnum):
    """Daemon and protocol error codes; disjoint from CUDA's (all >= 10000)."""

    CUCTXD_ERROR_BAD_REQUEST = 10001
    CUCTXD_ERROR_BAD_OP = 10002
    CUCTXD_ERROR_BAD_ARGUMENT = 10003
    CUCTXD_ERROR_UNKNOWN_HANDLE = 10004
    CUCTXD_ERROR_UNKNOWN_SESSION = 10005
    CUCTXD_ERROR_VERSION_MISMATCH = 10006
    CUCTXD_ERROR_TOO_LARGE = 10007
    CUCTXD_ERROR_OUT_OF_RANGE = 10008
    CUCTXD_ERROR_SESSION_EXPIRED = 10009
    CUCTXD_ERROR_SHUTTING_DOWN = 10010
    CUCTXD_ERROR_NOT_SHAREABLE = 10011
    CUCTXD_ERROR_LIMIT_EXCEEDED = 10012
    CUCTXD_ERROR_NAME_EXISTS = 10013
    CUCTXD_ERROR_NOT_FOUND = 10014
    CUCTXD_ERROR_NOT_OWNER = 10015
    CUCTXD_ERROR_REVOKED = 10016
    CUCTXD_ERROR_SESSION_CLOSED = 10017
    CUCTXD_ERROR_DIGEST_MISMATCH = 10018
    CUCTXD_ERROR_NOT_PARKED = 10019
    CUCTXD_ERROR_TIMED_OUT = 10020
    CUCTXD_ERROR_NO_COPY = 10022
    CUCTXD_ERROR_DEVICE_NOT_ALLOWED = 10024
    CUCTXD_ERROR_INTERNAL = 10099


class CuctxError(Exception):
    """Base of every cuctxd failure: a numeric code, a stable name, a message."""

    def __init__(self, code: int, name: str, message: str, op: str | None = None) -> None:
        self.code = code
        self.name = name
        self.message = message
        self.op = op
        super().__init__(self._describe())

    def _describe(self) -> str:
        """``op: NAME (code): message``; client-side errors have no wire code, so no ``(0)``."""
        where = f"{self.op}: " if self.op else ""
        code = f" ({self.code})" if self.code else ""
        return f"{where}{self.name}{code}: {self.message}"

    def with_op(self, op: str) -> CuctxError:
        """Return this error tagged with the op that failed (if not tagged yet)."""
        if self.op is None:
            self.op = op
            self.args = (self._describe(),)
        return self


class CudaError(CuctxError):
    """A CUDA driver call failed; ``code`` and ``name`` are CUDA's ``CUresult``."""

    @classmethod
    def of(cls, result: CUresult, detail: str = "") -> CudaError:
        """Build the error the driver would report, optionally with daemon context."""
        message = DRIVER_MESSAGES.get(result, result.name)
        if detail:
            message = f"{message} ({detail})"
        return cls(int(result), result.name, message)


class DaemonError(CuctxError):
    """A failure of the protocol or the daemon itself, not of the driver."""

    code_enum: ErrorCode = ErrorCode.CUCTXD_ERROR_INTERNAL

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(int(self.code_enum), self.code_enum.name, message, op)


class BadRequest(DaemonError):
    """The frames could not be decoded into a request."""

    code_enum = ErrorCode.CUCTXD_ERROR_BAD_REQUEST


class BadOp(DaemonError):
    """The request names an op this protocol version does not have."""

    code_enum = ErrorCode.CUCTXD_ERROR_BAD_OP


class BadArgument(DaemonError):
    """An argument is missing, of the wrong type, or out of its domain."""

    code_enum = ErrorCode.CUCTXD_ERROR_BAD_ARGUMENT


class UnknownHandle(DaemonError):
    """A context or buffer handle is not one this session holds on that device."""

    code_enum = ErrorCode.CUCTXD_ERROR_UNKNOWN_HANDLE


class UnknownSession(DaemonError):
    """The session token is missing, unknown, or already closed."""

    code_enum = ErrorCode.CUCTXD_ERROR_UNKNOWN_SESSION


class VersionMismatch(DaemonError):
    """The client speaks a protocol version the daemon does not."""

    code_enum = ErrorCode.CUCTXD_ERROR_VERSION_MISMATCH


class TooLarge(DaemonError):
    """A message, frame or requested size exceeds the daemon's limits."""

    code_enum = ErrorCode.CUCTXD_ERROR_TOO_LARGE


class OutOfRange(DaemonError):
    """An offset/size pair reaches outside the buffer it addresses."""

    code_enum = ErrorCode.CUCTXD_ERROR_OUT_OF_RANGE


class SessionExpired(DaemonError):
    """The session's lease ran out and the daemon reaped it."""

    code_enum = ErrorCode.CUCTXD_ERROR_SESSION_EXPIRED


class ShuttingDown(DaemonError):
    """The daemon is draining and accepts no new work."""

    code_enum = ErrorCode.CUCTXD_ERROR_SHUTTING_DOWN


class NotShareable(DaemonError):
    """A buffer cannot be shared the way that was asked."""

    code_enum = ErrorCode.CUCTXD_ERROR_NOT_SHAREABLE


class LimitExceeded(DaemonError):
    """A per-session or per-peer object limit would be exceeded."""

    code_enum = ErrorCode.CUCTXD_ERROR_LIMIT_EXCEEDED


class NameExists(DaemonError):
    """A shared-buffer name is already published."""

    code_enum = ErrorCode.CUCTXD_ERROR_NAME_EXISTS


class NotFound(DaemonError):
    """No published name or shared buffer matches (never was, or is gone)."""

    code_enum = ErrorCode.CUCTXD_ERROR_NOT_FOUND


class NotOwner(DaemonError):
    """Only the session that owns a shared buffer or name may do this."""

    code_enum = ErrorCode.CUCTXD_ERROR_NOT_OWNER


class Revoked(DaemonError):
    """The owner of a shared buffer revoked it: the session's hold was dropped; close any mapping of it."""

    code_enum = ErrorCode.CUCTXD_ERROR_REVOKED


class SessionClosed(DaemonError):
    """Another session closed this one (``close_session``, ``cuctx kill``): its objects are gone."""

    code_enum = ErrorCode.CUCTXD_ERROR_SESSION_CLOSED


class DigestMismatch(DaemonError):
    """A layout's bytes are not what its digest says: ``verify_shared`` hashed them on the device and they
    differ (the message names the publisher), or the name holds another digest, or none. Also raised by the
    client, before asking the daemon, for a layout whose manifest states another digest. Nothing stays
    mapped or held."""

    code_enum = ErrorCode.CUCTXD_ERROR_DIGEST_MISMATCH


class NotParked(DaemonError):
    """A ``persistent`` publish whose share the service manager's fd store cannot keep (the store, the uid's
    share of it or the fd budget is full, the store refused it, or the memory has no fd): nothing was published."""

    code_enum = ErrorCode.CUCTXD_ERROR_NOT_PARKED


class NoCopy(NotFound):
    """The name is published, but has no copy on the device asked for (the caller's own GPU, or ``device=``);
    the message lists the devices that have one. Making a copy is its publisher's decision
    (``cuctx load ... --device N``, ``ensure_copy``)."""

    code_enum = ErrorCode.CUCTXD_ERROR_NO_COPY


class DeviceNotAllowed(DaemonError):
    """``gpu_limit``: the device is not one of the GPUs the kubelet gave the client's pod, or the daemon cannot
    tell the client's pod (on ``hello``); the message says which."""

    code_enum = ErrorCode.CUCTXD_ERROR_DEVICE_NOT_ALLOWED


class TimedOut(DaemonError, TimeoutError):
    """A wait the daemon bounds passed its timeout: ``wait_version`` saw no newer version in time."""

    code_enum = ErrorCode.CUCTXD_ERROR_TIMED_OUT


class InternalError(DaemonError):
    """A daemon bug; the daemon logged the traceback and goes on serving."""

    code_enum = ErrorCode.CUCTXD_ERROR_INTERNAL


class DaemonTimeout(CuctxError, TimeoutError):
    """Client side only: the daemon did not answer in time (never sent on the wire); a TimeoutError as well,
    so code that handles timeouts in general handles this one."""

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(0, "CUCTXD_TIMEOUT", message, op)


class ConnectionLost(CuctxError, ConnectionError):
    """Client side only: the client's transport is closed or failed; a ConnectionError as well (so are
    :class:`NoDaemon` and :class:`DaemonRestarted`)."""

    error_name = "CUCTXD_CONNECTION_LOST"

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(0, self.error_name, message, op)


class NoAccess(ConnectionLost, PermissionError):
    """Client side only: this process may not connect to the ipc:// endpoint (a directory on its path it
    may not enter, or a socket file it may not write); raised at once, with what to change. A
    PermissionError as well."""

    error_name = "CUCTXD_NO_ACCESS"


class NoDaemon(ConnectionLost):
    """Client side only: nothing listens at the ipc:// endpoint (no socket file, or it refuses
    connections), so the client fails at once instead of waiting for a reply that cannot come."""

    error_name = "CUCTXD_NO_DAEMON"


class DaemonRestarted(NoDaemon):
    """Client side only: the daemon process that held this session exited and another one listens at the
    endpoint now (a pidfd of the old daemon polled readable, or ``ping`` answered with another
    ``instance``: PROTOCOL.md, section 5, "Across a restart"). The new daemon cannot know the session: the
    client raises :class:`SessionLost` for it at once instead of waiting for a reply that cannot come."""

    error_name = "CUCTXD_DAEMON_RESTARTED"


class SessionLost(ConnectionLost):
    """Client side only: the daemon stopped, or restarted and no longer knows this session.

    Every context, buffer, stream and event of the old session is gone with it.
    ``client.reconnect()`` (or ``Client(..., reconnect=True)``) starts a new session
    on the same client.
    """

    error_name = "CUCTXD_SESSION_LOST"


class WrongBackend(CuctxError, AttributeError):  # type: ignore[misc]  # ``name`` is the error's, not an attribute's
    """Client side only: a property of an opened share that its backend does not have (a sim share's
    ``ptr``); an AttributeError as well, so ``hasattr`` answers False instead of raising."""

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(0, "CUCTXD_WRONG_BACKEND", message, op)


_DAEMON_ERRORS: dict[int, type[DaemonError]] = {
    int(cls.code_enum): cls
    for cls in (
        BadRequest, BadOp, BadArgument, UnknownHandle, UnknownSession, VersionMismatch,
        TooLarge, OutOfRange, SessionExpired, ShuttingDown, NotShareable, LimitExceeded,
        NameExists, NotFound, NotOwner, Revoked, SessionClosed, DigestMismatch, NotParked, NoCopy,
        DeviceNotAllowed, TimedOut, InternalError,
    )
}


def error_to_wire(error: CuctxError) -> dict[str, Any]:
    """The ``error`` map of a failed reply."""
    return {"code": error.code, "name": error.name, "message": error.message}


def error_from_wire(wire: dict[str, Any], op: str | None = None) -> CuctxError:
    """Rebuild the typed exception a reply's ``error`` map describes."""
    code = int(wire.get("code", 0))
    name = str(wire.get("name", "UNKNOWN"))
    message = str(wire.get("message", ""))
    if code in _DAEMON_ERRORS:
        return _DAEMON_ERRORS[code](message, op)
    if 0 < code < int(ErrorCode.CUCTXD_ERROR_BAD_REQUEST):
        return CudaError(code, name, message, op)
    return CuctxError(code, name, message, op)
