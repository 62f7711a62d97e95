"""What both client flavours share and drive, with no I/O: the session, the routes, the lost-session rule.

:class:`~cuctxd.client.client.Client` and :class:`~cuctxd.client.async_client.AsyncClient`
each run the same requests (:mod:`cuctxd.client.requests`) over their own
transports. What they know of the session (:class:`SessionState`), which socket
each request takes (:class:`Router`, over :mod:`cuctxd.client.lanes`) and when a
session counts as lost are decided here, once. The client objects
(:mod:`cuctxd.client.objects`, :mod:`~cuctxd.client.streams`, :mod:`~cuctxd.client.sharing`)
are typed against :class:`Session` and :class:`AsyncSession`, not the client
classes, so they import nothing of the clients.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from cuctxd.client.data_plane import DataPlane
from cuctxd.client.lanes import FRONT, Lanes, Reach, Route, lane_endpoints
from cuctxd.client.requests import Plan, Request
from cuctxd.client.stream_ordered import Outbox
from cuctxd.protos.errors import ConnectionLost, CuctxError, DaemonRestarted, NoDaemon, NotShareable, SessionLost
from cuctxd.protos.host import host_identity

T = TypeVar("T")


class Session(Protocol):
    """A sync client as its objects see it: runs requests and plans, knows the daemon's limits."""

    limits: dict[str, int]

    def run(self, operation: Request[T] | Plan[T], /) -> T: ...


class AsyncSession(Protocol):
    """An async client as its objects see it: awaits requests and plans, knows the daemon's limits."""

    limits: dict[str, int]

    def run(self, operation: Request[T] | Plan[T], /) -> Awaitable[T]: ...


def not_listening(endpoint: str) -> str:
    return f"no cuctxd is listening at {endpoint}; start it with `cuctxd`"


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

    def _adopt(self, hello: dict[str, Any], use_lanes: bool) -> list[str]:
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
        if not use_lanes:
            return []
        return lane_endpoints(self.endpoint, hello.get("endpoints", ()), hello.get("device_endpoints", ()))

    _plane: DataPlane | None = None
    _outbox: Outbox

    def _open_data_plane(self, hello: dict[str, Any]) -> None:
        """Set up the data plane when ``hello`` names an fd channel this process can reach."""
        path = hello.get("fd_channel")
        self._plane = DataPlane(path, self.timeout) if path and hello.get("host") == host_identity() else None

    def _close_data_plane(self) -> None:
        if self._plane is not None:
            self._plane.close()
            self._plane = None

    def data_plane(self, *, required: bool = True) -> DataPlane | None:
        """The client's data plane; without one (no fd channel: tcp://, another host) None, or
        :class:`~cuctxd.protos.errors.NotShareable` when ``required``."""
        if self._plane is None and required:
            raise NotShareable(f"the daemon at {self.endpoint} offers no fd channel to this process (it has one "
                               "only beside an ipc:// endpoint on this host): connect over ipc:// to map "
                               "pool shares or host buffers")
        return self._plane

    def _check_session(self, op: str | None) -> bool:
        """Called when there is no session token: True when the client should start a new session
        now (``reconnect=True``); else raises why there is none."""
        if self._lost is None:
            raise ConnectionLost("the client is closed", op)
        if self._reconnect:
            return True
        raise SessionLost(self._lost.message, op)

    def _lose(self, error: CuctxError) -> SessionLost:
        """The session is gone (the daemon stopped, or restarted and forgot it): remember it, so later
        calls fail at once (or reconnect), and return the error to raise."""
        if isinstance(error, NoDaemon) and not isinstance(error, DaemonRestarted):
            why = f"{not_listening(self.endpoint)} any more"
        else:
            why = f"the daemon at {self.endpoint} no longer knows this session (it was restarted)"
        self._token = None
        self._lost = SessionLost(
            f"{why}; the session's contexts, buffers, streams and events are gone: call reconnect() "
            "(or create the client with reconnect=True) for a new session", error.op)
        return self._lost


class InFlight(Protocol):
    @property
    def reach(self) -> Reach: ...


class Wire(Protocol):
    """A transport as the router sees it."""

    @property
    def busy(self) -> bool: ...

    def in_flight(self) -> Sequence[InFlight]: ...


TransportT = TypeVar("TransportT", bound=Wire)


class Router(Generic[TransportT]):
    """The transports of one session (the main endpoint's, and each device lane's once used), and which
    one each request takes. Not thread-safe: the sync client locks around it, the async one runs on one loop."""

    def __init__(self, main: TransportT, endpoints: Sequence[str], open_lane: Callable[[str], TransportT]) -> None:
        self.main = main
        self.lanes = Lanes(endpoints)
        self.lane_transports: dict[int, TransportT] = {}
        self._open_lane = open_lane

    def pick(self, op: str, args: dict[str, Any]) -> tuple[Route, TransportT]:
        """The route of a request and the transport it goes on (a lane's is opened on first use)."""
        route = self.lanes.route(op, args)
        if route.lane == FRONT:
            return route, self.main
        transport = self.lane_transports.get(route.lane)
        if transport is None:
            transport = self.lane_transports[route.lane] = self._open_lane(self.lanes.endpoints[route.lane])
        return route, transport

    def conflicts(self, route: Route) -> Iterator[TransportT]:
        """The other transports whose calls in flight a request on ``route`` must wait for (all of them)."""
        for lane, transport in ((FRONT, self.main), *self.lane_transports.items()):
            if lane != route.lane and transport.busy and Lanes.conflicts(
                    route, lane, (call.reach for call in transport.in_flight())):
                yield transport

    def transports(self) -> Iterable[TransportT]:
        return (self.main, *self.lane_transports.values())
