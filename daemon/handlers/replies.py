"""What a handler hands back: a reply, or work that another thread finishes.

Handlers never touch sockets. They return :class:`Reply` (sent at once),
:class:`Pending` (the worker polls ``done`` between requests and replies once it
is true, so a synchronize never blocks the worker), :class:`Forward` (a device
worker passes the job on to another device's worker, e.g. the second half of a
cross-device copy) or, from the front, :class:`FanOut` (every worker
contributes, the last one to finish sends the reply) and :class:`Deferred` (the
front answers once a lookup that waits on a service outside the daemon has run
beside it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cuctxd.daemon.device.entries import Marker
from cuctxd.daemon.device.shm_lanes import ShmLane
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.streams import Streams
from cuctxd.daemon.registry.sessions import Session


@dataclass
class Reply:
    """A successful result map plus payload frames (zero-copy buffers)."""

    result: dict[str, Any] = field(default_factory=dict)
    frames: Sequence[Any] = ()


@dataclass
class Pending:
    """Reply with ``then()`` once ``done()`` (a non-blocking query) returns True. With ``on_ring``, not
    polled: it waits on that shm lane until the lane's next ring (an early request's data ring)."""

    done: Callable[[], bool]
    then: Callable[[], Reply]
    on_ring: ShmLane | None = None


def after_markers(streams: Streams, markers: list[Marker], reply: Reply) -> Pending:
    """Answer ``reply`` once every marker has passed (the markers go back to the spares then)."""

    def then() -> Reply:
        streams.recycle_markers(markers)
        return reply

    return Pending(lambda: streams.markers_done(markers), then)


@dataclass
class Forward:
    """Continue on device ``device``'s worker thread with ``then(state)`` (from a device handler, or from a
    front handler whose op must finish on a worker, ``unpublish``); that worker sends the reply."""

    device: int
    then: Callable[[DeviceState], Reply | Pending | Forward]


@dataclass
class FanOut:
    """Run ``each(state)`` on every device worker, then ``finish(parts)`` on the last one.

    ``parts`` is ordered by device index. ``finish`` runs on a worker thread, so
    it may only use what the parts and its closure carry. With ``after``, each
    worker runs ``each`` once that session's requests queued on its device have
    run (a session's close).
    """

    each: Callable[[DeviceState], Any]
    finish: Callable[[list[Any]], Reply]
    after: Session | None = None


@dataclass
class Deferred:
    """From a front handler: answer with ``then(result)`` (on the front thread) once ``look_up()`` has run on
    the front's lookup pool (:mod:`cuctxd.daemon.front.lookups`), because it waits on a service outside the
    daemon, which the front thread never does. An error ``look_up`` raises is the reply. Requests whose
    ``key`` is the same wait on one ``look_up``."""

    key: str
    look_up: Callable[[], Any]
    then: Callable[[Any], Reply]


class Gather:
    """Collects one part per device for a :class:`FanOut`; thread-safe."""

    def __init__(self, fan_out: FanOut, device_count: int) -> None:
        self._fan_out = fan_out
        self._parts: list[Any] = [None] * device_count
        self._left = device_count
        self._lock = threading.Lock()

    def contribute(self, index: int, part: Any) -> Reply | None:
        """Store a part; return the finished reply to whoever contributed last."""
        with self._lock:
            self._parts[index] = part
            self._left -= 1
            if self._left:
                return None
        return self._fan_out.finish(self._parts)
