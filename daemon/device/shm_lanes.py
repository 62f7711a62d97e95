"""The sessions' shm lanes to this device, as what they hold: a memfd region and two eventfds each.

A round trip over ZeroMQ costs about twice what an eventfd's does between two processes, and a small device
op is little more than its round trip. A session with a data plane may ask for a lane (``shm_lane``): a
memfd region of :data:`~cuctxd.protos.shm_lane.REGION_BYTES` (sealed against resizing,
:mod:`cuctxd.protos.memfd`) and two eventfds, handed over the fd channel. Here is what a lane holds, its
bound (``max_shm_lanes``), its charge in the fd budget and its close; how the worker takes requests from
the region and answers them there (same checks, same queues, same order as the ROUTER's) is
:mod:`cuctxd.daemon.worker.shm_io`, the worker loop's. Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`; one lane per session, closed with the session.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.errors import BadRequest, LimitExceeded
from cuctxd.protos.memfd import sealed_memfd
from cuctxd.protos.shm_lane import REGION_BYTES, mark_closed

#: Default of ``max_shm_lanes``: lanes open to one device at once (each holds a 128 KiB memfd and 3 fds).
DEFAULT_MAX_SHM_LANES = 1024
#: Fds a lane holds in the daemon: its memfd, two eventfds, and the one its mapping keeps (Python's ``mmap``).
LANE_FDS = 4


@dataclass(eq=False)
class ShmLane:
    """One session's lane: the region mapped here, its memfd and eventfds (daemon's copies)."""

    session: SessionRef
    memfd: int
    requests: int
    replies: int
    region: mmap.mmap
    #: Its :data:`LANE_FDS` in the daemon's fd budget, given back when it closes.
    charge: FdCharge | None = None
    view: memoryview = field(init=False)
    #: The request and reply fields below are the worker loop's (:mod:`cuctxd.daemon.worker.shm_io`).
    #: The sequence number of the last request taken, and whether its reply is still to come.
    seq: int = 0
    busy: bool = False
    #: Whether that request is early, and the rings since it was taken (its data ring among them).
    early: bool = False
    rung: int = 0
    #: An early request's reply is in the area, its ring waits for the data ring.
    owing: bool = False
    #: ``(job, pending)`` of an early copy that runs on the data ring (the worker's to run).
    parked: tuple[Any, Any] | None = None

    def __post_init__(self) -> None:
        self.view = memoryview(self.region)

    def ring(self) -> bool:
        """Ring the reply eventfd; False when it cannot take another ring (only a client that wrote its counter
        near the top can do that: the fd is non-blocking, so the worker never waits on it)."""
        try:
            os.eventfd_write(self.replies, 1)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        """Tell the client (the closed flag, one more ring: a request it still waits for will not be
        answered here), then let go of everything."""
        mark_closed(self.view)
        self.ring()
        self.view.release()
        with contextlib.suppress(BufferError):
            self.region.close()
        for fd in (self.memfd, self.requests, self.replies):
            os.close(fd)
        if self.charge is not None:
            self.charge.release()


class ShmLanes:
    """Every session's lane to this device, by session token and by request eventfd.

    ``watch(fd, on)``: how the worker starts (``on``) or stops polling a lane's
    request eventfd; set by the worker before any lane opens. ``limit``: ``max_shm_lanes`` (0: none).
    ``budget``: where each lane's fds count (None: a budget of its own that never refuses).
    """

    def __init__(self, limit: int = 0, budget: FdBudget | None = None) -> None:
        self.limit = limit
        self.budget = budget if budget is not None else FdBudget()
        #: A pidfd of this daemon, a copy of which goes with every lane: it polls readable once this process
        #: exits, so a client waiting on a lane learns at once that its daemon is gone (None: no pidfds here).
        self._pidfd = _own_pidfd()
        self.by_session: dict[str, ShmLane] = {}
        self.by_fd: dict[int, ShmLane] = {}
        self.watch: Callable[[int, bool], None] | None = None
        #: Early copies parked on their lanes (an int: other threads read it for the worker's queue depth).
        self.parked = 0

    def open(self, session: SessionRef) -> list[int]:
        """A new lane for ``session`` (one each): fds for the client (memfd, request and reply eventfds;
        the caller owns them)."""
        if session.token in self.by_session:
            raise BadRequest("this session already has an shm lane to this device")
        if self.watch is None:
            raise BadRequest("this device takes no shm lanes (its worker has no endpoint of its own)")
        if self.limit and len(self.by_session) >= self.limit:
            raise LimitExceeded(f"max_shm_lanes: {len(self.by_session)} shm lanes are open to this device; "
                                "this session's requests take the socket")
        charge = self.budget.charge(LANE_FDS, "an shm lane", session.fd_peer or session.token, session.token)
        fds: list[int] = []
        try:
            fds.append(sealed_memfd("cuctxd-shm-lane", REGION_BYTES))
            fds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            fds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            region = mmap.mmap(fds[0], REGION_BYTES)
            client = [os.dup(fd) for fd in fds]
            if self._pidfd is not None:
                client.append(os.dup(self._pidfd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            charge.release()
            raise
        lane = ShmLane(session, fds[0], fds[1], fds[2], region, charge)
        self.by_session[session.token] = self.by_fd[lane.requests] = lane
        self.watch(lane.requests, True)
        return client

    def close(self, token: str) -> None:
        """Close the session's lane, if it has one (its session ended)."""
        lane = self.by_session.pop(token, None)
        if lane is None:
            return
        del self.by_fd[lane.requests]
        if self.watch is not None:
            self.watch(lane.requests, False)
        if lane.parked is not None:  # its copy will not run: the session that sent it is gone
            lane.parked = None
            self.parked -= 1
        lane.close()

    def close_all(self) -> None:
        for token in list(self.by_session):
            self.close(token)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __len__(self) -> int:
        return len(self.by_session)


def _own_pidfd() -> int | None:
    """A pidfd of this process (``pidfd_open``, Linux 5.3+), or None where there is none to be had."""
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return None
