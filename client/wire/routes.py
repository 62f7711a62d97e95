"""Which transport each request takes: the daemon's main endpoint, its device's own endpoint, or the shm lane.

Vocabulary (the client's; ``client/ARCHITECTURE.md``): a *device endpoint* is a
device's own socket in the daemon (``hello``: ``device_endpoints``, see
``protos/PROTOCOL.md``, "Device endpoints"), answered by that device's worker
without a thread hand-off; an *shm lane* is the shared-memory transport to a
device (:mod:`cuctxd.client.wire.shm_lane`); a *route* is where one request goes
(:class:`Route`): ``via`` the main endpoint (:data:`MAIN`), device N's endpoint
(``N``) or the shm lane to device N (:func:`shm_via`).

The client sends every device op for device N to device N's endpoint (or its
shm lane, when the request may take it), and everything else to the main one.
It works out the device as the daemon does: the ``device`` argument, else the
session's current device, which only ``set_device`` changes, so the client can
follow it exactly (:class:`Routes`).

Requests of one session that reach the same device must arrive in the order
sent, but two transports do not keep order between them. So before a request
goes out on one transport, the requests still in flight on others that reach one
of the same devices are waited for (:meth:`Router.conflicts`). That only ever
happens in pipelines that mix front ops, cross-device copies, or both paths;
plain calls have nothing in flight.

:class:`Router` is the one place that picks a request's transport, for both
client flavours (the async one has no shm lanes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, overload

from cuctxd.client.wire.shm_lane import ShmLanes, ShmTransport, eligible
from cuctxd.client.wire.transport import Reach
from cuctxd.protos.schema import OPS

#: The ``via`` of the daemon's main endpoint.
MAIN = -1


def shm_via(device: int) -> int:
    """The ``via`` of the shm lane to ``device`` (below the main endpoint's -1)."""
    return -2 - device


def device_endpoints(endpoint: str, endpoints: Sequence[str],
                     per_device: Sequence[Sequence[str]]) -> list[str]:
    """The endpoint of each device's own socket as this client reaches it; [] if there is none to use.

    ``endpoints`` and ``per_device`` are hello's ``endpoints`` and
    ``device_endpoints``: the daemon's main endpoints and, per device, its socket
    next to each. This client's ``endpoint`` picks the column: the same string,
    else (tcp) the same port, with the host this client used (the device sockets
    listen on the same interface as the main one).
    """
    column = _column(endpoint, endpoints)
    if column is None or any(len(sockets) <= column for sockets in per_device):
        return []
    if not endpoint.startswith("tcp://"):
        return [sockets[column] for sockets in per_device]
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return [f"tcp://{host}:{sockets[column].rpartition(':')[2]}" for sockets in per_device]


def _column(endpoint: str, endpoints: Sequence[str]) -> int | None:
    if endpoint in endpoints:
        return list(endpoints).index(endpoint)
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        for index, bound in enumerate(endpoints):
            if bound.startswith("tcp://") and bound.rpartition(":")[2] == port:
                return index
    return None


class Route(NamedTuple):
    """Where a request goes (``via``: :data:`MAIN`, a device index, or :func:`shm_via` of one) and what it
    reaches."""

    via: int
    reach: Reach

    @property
    def device(self) -> int:
        """The device whose endpoint or shm lane the route takes (:data:`MAIN` for the main endpoint)."""
        return self.via if self.via >= MAIN else shm_via(self.via)


#: The route of every front op, and of every request while there are no device endpoints.
_MAIN = Route(MAIN, None)


class Routes:
    """Routes a session's requests to the main endpoint or a device endpoint; follows its current device.
    Not thread-safe: the client locks."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.current_device = 0

    def route(self, op: str, args: Mapping[str, Any]) -> Route:
        """The route of ``op`` with wire ``args``; a ``set_device`` moves the current device as it goes."""
        spec = OPS.get(op)
        if spec is None or spec.target != "device" or not self.endpoints:
            return _MAIN
        device = args.get("device", self.current_device)
        if not self._serves(device):
            return _MAIN  # the main endpoint answers with the error the spec gives
        if op == "set_device":
            self.current_device = device
        dst = args.get("dst_device")
        return Route(device, frozenset((device,) if dst is None or dst == device else (device, dst)))

    def _serves(self, device: Any) -> bool:
        return isinstance(device, int) and not isinstance(device, bool) and 0 <= device < len(self.endpoints)

    @staticmethod
    def conflicts(route: Route, via: int, reaches: Iterable[Reach]) -> bool:
        """Whether a request on ``route`` must wait for requests in flight on another transport (``via``) that
        reach ``reaches``."""
        return via != route.via and any(
            r is None or route.reach is None or not r.isdisjoint(route.reach) for r in reaches)


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
    """The transports of one session and which one each request takes: the main endpoint's socket, each
    device endpoint's socket once used, and, given ``open_shm`` (the sync client with a data plane and device
    endpoints), each device's shm lane once opened. Not thread-safe: the sync client locks around it, the
    async one runs on one loop."""

    def __init__(self, main: TransportT, endpoints: Sequence[str], open_socket: Callable[[str], TransportT],
                 open_shm: Callable[[int], ShmTransport | None] | None = None) -> None:
        self.main = main
        self.routes = Routes(endpoints)
        self.device_sockets: dict[int, TransportT] = {}
        self._open_socket = open_socket
        #: The shm lanes by device, or None when the session has none.
        self.shm = None if open_shm is None else ShmLanes(open_shm)

    @overload
    def pick(self, op: str, args: dict[str, Any]) -> tuple[Route, TransportT]: ...

    @overload
    def pick(self, op: str, args: dict[str, Any], *, shm: bool) -> tuple[Route, TransportT | ShmTransport]: ...

    def pick(self, op: str, args: dict[str, Any], *, shm: bool = False) -> tuple[Route, TransportT | ShmTransport]:
        """The route of a request and the transport it goes on. ``shm``: the shm lane to its device when the
        request may take one (:func:`~cuctxd.client.wire.shm_lane.eligible`) and it is usable (opened on
        first use); else its socket (a device endpoint's is opened on first use)."""
        route = self.routes.route(op, args)
        if shm and self.shm is not None and route.via != MAIN and eligible(op, args, route.via, route.reach):
            lane = self.shm.for_device(route.via)
            if lane is not None:
                return Route(shm_via(route.via), route.reach), lane
        return self.socket(route)

    def socket(self, route: Route) -> tuple[Route, TransportT]:
        """The route of the socket ``route`` takes or falls back to (an shm lane's: its device endpoint's), and
        that socket."""
        if route.via == MAIN:
            return route, self.main
        device = route.device
        transport = self.device_sockets.get(device)
        if transport is None:
            transport = self.device_sockets[device] = self._open_socket(self.routes.endpoints[device])
        return Route(device, route.reach), transport

    def conflicts(self, route: Route) -> Iterator[TransportT | ShmTransport]:
        """The other transports whose calls in flight a request on ``route`` must wait for (all of them)."""
        for via, transport in self._by_via():
            if via != route.via and transport.busy and Routes.conflicts(
                    route, via, (call.reach for call in transport.in_flight())):
                yield transport

    def _by_via(self) -> Iterator[tuple[int, TransportT | ShmTransport]]:
        yield MAIN, self.main
        yield from self.device_sockets.items()
        if self.shm is not None:
            for device, lane in self.shm.opened():
                yield shm_via(device), lane

    def sockets(self) -> Iterable[TransportT]:
        return (self.main, *self.device_sockets.values())
