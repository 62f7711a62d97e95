"""Which socket each request takes: the daemon's main endpoint, or its device's own.

A daemon that offers device endpoints (``hello``: ``device_endpoints``, see
``protos/PROTOCOL.md``, "Device endpoints") answers device ops sent there
without a thread hand-off. The client sends every device op for device N to
device N's endpoint, and everything else to the main one. It works out the
device as the daemon does: the ``device`` argument, else the session's current
device, which only ``set_device`` changes, so the client can follow it exactly.

Requests of one session that reach the same device must arrive in the order
sent, but two sockets do not keep order between them. So before a request goes
out on one lane, the requests still in flight on other lanes that reach one of
the same devices are waited for (:meth:`Lanes.conflicts`). That only ever
happens in pipelines that mix front ops, cross-device copies, or both paths;
plain calls have nothing in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from cuctxd.protos.schema import OPS

#: The lane of the daemon's main endpoint.
FRONT = -1

#: What a request reaches: the devices it touches, or None for every device (front ops).
Reach = frozenset[int] | None


def lane_endpoints(endpoint: str, endpoints: Sequence[str], device_endpoints: Sequence[Sequence[str]]) -> list[str]:
    """The endpoint of each device's own socket as this client reaches it; [] if there is none to use.

    ``endpoints`` and ``device_endpoints`` are hello's: the daemon's main
    endpoints and, per device, its socket next to each. This client's
    ``endpoint`` picks the column: the same string, else (tcp) the same port,
    with the host this client used (the device sockets listen on the same
    interface as the main one).
    """
    column = _column(endpoint, endpoints)
    if column is None or any(len(per_device) <= column for per_device in device_endpoints):
        return []
    if not endpoint.startswith("tcp://"):
        return [per_device[column] for per_device in device_endpoints]
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return [f"tcp://{host}:{per_device[column].rpartition(':')[2]}" for per_device in device_endpoints]


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
    """Where a request goes (a device index, or :data:`FRONT`) and what it reaches."""

    lane: int
    reach: Reach


#: The route of every front op, and of every request while there are no lanes.
_MAIN = Route(FRONT, None)


class Lanes:
    """Routes a session's requests; follows its current device. Not thread-safe: the client locks."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.current_device = 0

    def route(self, op: str, args: Mapping[str, Any]) -> Route:
        """The lane for ``op`` with wire ``args``; a ``set_device`` moves the current device as it goes."""
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
    def conflicts(route: Route, lane: int, reaches: Iterable[Reach]) -> bool:
        """Whether a request on ``route`` must wait for requests in flight on another ``lane`` that reach
        ``reaches``."""
        return lane != route.lane and any(
            r is None or route.reach is None or not r.isdisjoint(route.reach) for r in reaches)
