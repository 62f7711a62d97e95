"""What both client flavours share and drive, with no I/O: the session and the lost-session rule.

:class:`~cuctxd.client.api.client.Client` and :class:`~cuctxd.client.api.async_client.AsyncClient`
each run the same requests (:mod:`cuctxd.client.wire.build`) over their own
transports. What they know of the session (:class:`SessionState`) and when a
session counts as lost are decided here, once; which transport each request takes
is :mod:`cuctxd.client.wire.routes`'s. The client objects
(:mod:`cuctxd.client.api.objects`, :mod:`~cuctxd.client.api.streams`, :mod:`~cuctxd.client.api.sharing`)
are typed against :class:`Session` and :class:`AsyncSession`, not the client
classes, so they import nothing of the clients.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from cuctxd.client.wire.build import Plan, Request
from cuctxd.client.wire.routes import device_endpoints
from cuctxd.client.wire.stream_ordered import Outbox
from cuctxd.protos.errors import ConnectionLost, CuctxError, DaemonRestarted, NoDaemon, SessionClosed, SessionLost

T = TypeVar("T")


class Session(Protocol):
    """A sync client as its objects see it: runs requests and plans, knows the daemon's limits."""

    limits: dict[str, int]

    def run(self, operation: Request[T] | Plan[T], /) -> T: ...


class AsyncSession(Protocol):
    """An async client as its objects see it: awaits requests and plans, knows the daemon's limits."""

    limits: dict[str, int]

    def run(self, operation: Request[T] | Plan[T], /) -> Awaitable[T]: ...


class SessionState:
    """What a client knows of its session once ``hello`` has answered, and whether it was lost.

    ``_token`` is None before ``hello``, after :meth:`_lose` and after ``close``;
    :meth:`_check_session` says what a call then does. Which thread may call: the
    client's callers, under the client's own serialisation.
    """

    endpoint: str
    timeout: float
    _token: str | None = None
    _lost: SessionLost | None = None
    _reconnect = False

    def _adopt(self, hello: dict[str, Any], use_device_endpoints: bool) -> list[str]:
        """Take in ``hello``'s answer; returns the device endpoints to route to ([] for none)."""
        self._token = hello["session"]
        self._lost = None
        self._outbox = Outbox()
        self.session_id: int = hello["session_id"]
        self.daemon_version: str = hello["daemon_version"]
        previous = getattr(self, "instance", None)
        #: The daemon's instance id (random per daemon start; None from a daemon that does not say).
        self.instance: str | None = hello.get("instance")
        #: Whether this session is with another daemon instance than the client's previous session was (a
        #: reconnect after a restart): shares opened before stay mapped; re-adopted names can be opened again.
        self.restarted: bool = previous is not None and previous != self.instance
        self.protocol: int = hello["protocol"]
        self.backend: str = hello["backend"]
        self.limits: dict[str, int] = hello["limits"]
        self.lease_ttl: float = hello["lease_ttl"]
        #: The indices of the devices this session may use (``gpu_limit``: its pod's GPUs); None: every device.
        self.allowed_devices: list[int] | None = hello.get("allowed_devices")
        if not use_device_endpoints:
            return []
        return device_endpoints(self.endpoint, hello.get("endpoints", ()), hello.get("device_endpoints", ()))

    _outbox: Outbox

    @property
    def has_session(self) -> bool:
        """Whether a session is open now: False before ``hello``, once it was lost and after ``close``."""
        return self._token is not None

    def _check_session(self, op: str | None) -> bool:
        """Called when there is no session token: True when the client should start a new session
        now (``reconnect=True``); else raises why there is none."""
        if self._lost is None:
            raise ConnectionLost("the client is closed", op)
        if self._reconnect:
            return True
        raise SessionLost(self._lost.message, op) from self._lost.__cause__  # why it was lost

    def _lose(self, error: CuctxError) -> SessionLost:
        """The session is gone (the daemon stopped, or restarted and forgot it): remember it, so later
        calls fail at once (or reconnect), and return the error to raise."""
        if isinstance(error, NoDaemon) and not isinstance(error, DaemonRestarted):
            why = (f"the daemon at {self.endpoint} stopped: nothing listens there any more "
                   "(start it again with `cuctxd`)")
        elif isinstance(error, SessionClosed):
            why = f"the daemon at {self.endpoint} says {error.message}"
        else:
            why = f"the daemon at {self.endpoint} no longer knows this session (it was restarted)"
        self._token = None
        self._lost = SessionLost(
            f"{why}; the session's contexts, buffers, streams and events are gone: call reconnect() "
            "(or create the client with reconnect=True) for a new session", error.op)
        return self._lost
