"""The sessions' shm lanes to this device: device ops through shared memory, woken by eventfds.

A round trip over ZeroMQ costs about twice what an eventfd's does between two processes, and a small device
op is little more than its round trip. A session with a data plane may ask for a lane (``shm_lane``): a
memfd region of :data:`~cuctxd.protos.shm_lane.REGION_BYTES` (sealed against resizing,
:mod:`cuctxd.protos.memfd`) and two eventfds, handed over the fd channel. The worker polls the request
eventfd beside its ROUTER, takes the request from the region, admits and runs it as any other (same checks,
same queues, same order: the client sends on one path at a time), and answers in the region. An **early**
request (sent before the bytes it copies from are in place) is checked at once, but its copy waits in
:attr:`ShmLane.parked` for the lane's next ring, and its reply, even an error, is rung only after that ring:
so no ring the client owes can meet a later request. The worker never waits to ring: both eventfds are
non-blocking, and a lane whose client filled the reply eventfd's counter is closed at the ring that fails
(:meth:`ShmLanes._ring`). Layout: :mod:`cuctxd.protos.shm_lane`. Owned by the device's worker thread, as
part of its :class:`~cuctxd.daemon.device.state.DeviceState`; one lane per session, closed with the session.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.errors import BadRequest, LimitExceeded, TooLarge
from cuctxd.protos.memfd import sealed_memfd
from cuctxd.protos.messages import encode_error
from cuctxd.protos.shm_lane import (
    MESSAGE_HEAD,
    REGION_BYTES,
    REPLY_AT,
    REQUEST_AT,
    fits,
    is_early,
    mark_closed,
    read_message,
    write_message,
)

log = logging.getLogger(__name__)

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

    def take(self, fd: int) -> tuple[ShmLane, bytes, bytes | None] | None:
        """The request the lane polled on ``fd`` rang for: ``(lane, header, payload)``; None when there is
        none to take (a ring while the last one is still being answered, an early request's data ring, or a
        number already taken). A message that does not fit its area raises :class:`BadRequest` (answered on
        the lane)."""
        lane = self.by_fd.get(fd)
        if lane is None:
            return None
        count = 0
        with contextlib.suppress(BlockingIOError):
            count = os.eventfd_read(fd)
        if lane.busy:  # an early request's data ring; else the client broke the one-at-a-time rule (its
            lane.rung += count  # request waits for this reply)
            return None
        if lane.owing and count:  # the data ring an early request's reply waited for
            count -= 1
            lane.owing = False
            if not self._ring(lane):
                return None
            if not count:
                return None
        seq = MESSAGE_HEAD.unpack_from(lane.view, REQUEST_AT)[0]
        if seq == lane.seq:
            return None
        lane.seq, lane.busy = seq, True  # from here on, even garbage is answered, under its number
        lane.early, lane.rung = is_early(lane.view, seq), max(0, count - 1)
        _, header, payload = read_message(lane.view, REQUEST_AT)
        return lane, header, payload

    def park(self, lane: ShmLane, job: Any, pending: Any) -> None:
        """Keep an early copy on its lane until the lane's data ring (:meth:`unpark`)."""
        lane.parked = (job, pending)
        self.parked += 1

    def unpark(self, fd: int) -> tuple[Any, Any] | None:
        """The early copy parked on the lane polled on ``fd``, once its data ring has come."""
        lane = self.by_fd.get(fd)
        if lane is None or lane.parked is None or not lane.rung:
            return None
        parked, lane.parked = lane.parked, None
        self.parked -= 1
        return parked

    def reply(self, lane: ShmLane, request_id: int, header: bytes, frames: Sequence[Any]) -> None:
        """Answer the lane's request (a lane closed meanwhile is skipped); a reply that does not fit its area
        is answered with ``CUCTXD_ERROR_TOO_LARGE`` instead. An early request's reply is rung only once its
        data ring has come."""
        if self.by_session.get(lane.session.token) is not lane:
            return
        payload: Any = memoryview(frames[0]).cast("B") if frames else None
        if len(frames) > 1 or not fits(len(header), 0 if payload is None else len(payload)):
            error = TooLarge(f"the reply ({len(header)} header bytes and {len(frames)} frame(s)) does not fit the "
                             "shm lane's area; send this request over the socket")
            header, payload = encode_error(request_id, error), None
        write_message(lane.view, REPLY_AT, lane.seq, header, payload)
        owing = lane.early and not lane.rung  # rung with the data ring still to come
        lane.busy, lane.early, lane.rung = False, False, 0
        if owing:
            lane.owing = True
        else:
            self._ring(lane)

    def _ring(self, lane: ShmLane) -> bool:
        """Ring ``lane``'s reply eventfd; a lane whose client filled the eventfd's counter is closed (logged
        once): its session's requests take the socket from then on. False if so."""
        if lane.ring():
            return True
        session = lane.session
        log.warning("session %d (%s, pid %d): its shm lane closed: the client filled the reply eventfd's counter, "
                    "so it cannot be rung; the session's requests take the socket", session.public_id,
                    session.client, session.pid)
        self.close(lane.session.token)
        return False

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
