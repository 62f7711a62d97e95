"""The client's end of an shm lane (PROTOCOL.md, "The shm lane"): small device ops without ZeroMQ.

A lane to device N is opened on the session's first device op there, when the
client has a data plane (ipc:// on the daemon's host): ``shm_lane`` over the
socket, then three fds through the fd channel. From then on a request that fits
(:func:`eligible`, :meth:`ShmTransport.try_send`) is written into the shared
region and rung with an eventfd; the reply comes back the same way, at about half
the cost of a ZeroMQ round trip. One request is out at a time; the client's
router (:mod:`cuctxd.client.wire.routes`) picks it for a request and keeps it in order
with the sockets, as for any other transport. A lane that timed out is not used again (a late reply must not
meet the next request). Which thread may call: the sync client's callers, under
its route lock.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cuctxd.client.wire.transport import PROBE_EVERY, Call, DaemonWatch, Reach, Sender, no_reply
from cuctxd.protos.errors import CuctxError, error_from_wire
from cuctxd.protos.messages import encode_request, parse_reply
from cuctxd.protos.schema import OPS
from cuctxd.protos.shm_lane import (
    MAX_MESSAGE_BYTES,
    REGION_BYTES,
    REPLY_AT,
    REQUEST_AT,
    fits,
    is_closed,
    mark_early,
    polls_busily,
    read_message,
    write_message,
)

#: Room left for the reply header of a ``read`` sent on a lane.
_REPLY_HEADER_ROOM = 1024
#: Seconds a caller polls for its reply without sleeping before it blocks: a small op's reply comes
#: within tens of microseconds, and being woken from sleep costs about as much again (more in a virtual
#: machine). Only on hosts with 8 CPUs or more, where the polling does not take the daemon's CPU.
BUSY_POLL_S = 200e-6 if polls_busily() else 0.0


class BusyPoll:
    """Whether to poll for the next reply without sleeping: only while replies typically come within
    ``window`` seconds (an average over the last few), so that a lane whose device is busy with other
    sessions' work waits asleep instead of taking CPU from them."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.typical = 0.0

    def worth_it(self) -> bool:
        return self.window > 0 and self.typical < self.window

    def observe(self, seconds: float) -> None:
        """A reply came ``seconds`` after its request was sent (counted as at most four windows, so that
        one long synchronize does not keep the lane from polling for the many short ops after it)."""
        self.typical += (min(seconds, 4 * self.window) - self.typical) / 4


def eligible(op: str, args: dict[str, Any], device: int, reach: Reach) -> bool:
    """Whether a request may take the shm lane to ``device``: a device op there alone, whose reply fits an
    area (only ``read`` replies with bytes)."""
    spec = OPS.get(op)
    if spec is None or spec.target != "device" or reach != frozenset((device,)):
        return False
    if spec.payload_out:
        size = args.get("size")
        return op == "read" and isinstance(size, int) and size <= MAX_MESSAGE_BYTES - _REPLY_HEADER_ROOM
    return True


class ShmTransport:
    """One shm lane: the region mapped here, the request and reply eventfds, and the daemon's pidfd when it
    sent one; the interface of a socket transport that the router and calls use (``busy``, ``in_flight``,
    ``wait``, ``abandon``), on the shared base (:mod:`cuctxd.client.wire.transport`)."""

    def __init__(self, fds: Sequence[int], watch: DaemonWatch, timeout: float, socket: Sender) -> None:
        """``fds``: as the ticket gave them (memfd, request and reply eventfds, then the daemon's pidfd, if
        any). ``watch``: the session's, asked while a reply is late. ``socket``: where a request goes instead
        once the daemon closed the lane under it (its session ended, the daemon stops); the reply, an error
        saying why, is the call's."""
        memfd, self._requests, self._replies, *pidfd = fds
        try:
            self._region = mmap.mmap(memfd, REGION_BYTES)
        finally:
            os.close(memfd)
        self._view = memoryview(self._region)
        self._poll = select.poll()
        self._poll.register(self._replies, select.POLLIN)
        #: Polls readable once the daemon process exits: a call then fails at once, whoever listens now.
        self._pidfd = pidfd[0] if pidfd else None
        if self._pidfd is not None:
            self._poll.register(self._pidfd, select.POLLIN)
        self._watch = watch
        self.daemon = watch.endpoint
        self.timeout = timeout
        self._socket = socket
        #: The request out on the lane: what it would take to send it on the socket instead.
        self._request: tuple[str, dict[str, Any], str | None, Sequence[Any]] = ("", {}, None, ())
        self._ids = itertools.count(1)
        self._seq = 0
        self._call: Call[Any] | None = None
        self._sent_at = 0.0
        self._busy_poll = BusyPoll(BUSY_POLL_S)
        #: False once a call timed out or the lane closed: requests take the socket from then on.
        self.usable = True
        self._closed = False
        self._lock = threading.RLock()
        #: Held only to ring or close the request eventfd, never while waiting: a thread waiting on an early
        #: call (under :attr:`_lock`) must not keep its sender from ringing the data ring it waits for.
        self._fd_lock = threading.Lock()

    def try_send(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any] = (), *,
                 into: Any, convert: Callable[[dict[str, Any], list[Any]], Any],
                 reach: Reach = None, early: bool = False) -> Call[Any] | None:
        """Send on the lane (after the call still out there, if any); None when the request does not fit.
        ``early``: before the bytes it copies from are in place, :meth:`source_ready` once they are (None
        if the lane was given up meanwhile: the socket must not have it before its bytes)."""
        if len(payload) > 1:
            return None
        data = memoryview(payload[0]).cast("B") if payload else None
        request_id = next(self._ids)
        header = encode_request(request_id, op, session, args)
        if not fits(len(header), 0 if data is None else data.nbytes):
            return None
        with self._lock:
            if self._call is not None:
                self.wait(self._call)
            call: Call[Any] = Call(self, request_id, op, into, convert, reach)
            if self.usable and is_closed(self._view):  # closed by the daemon with no call out
                self.usable = False
            if not self.usable:  # closed by the daemon, or given up, while the last call was out
                return None if early else self._resend(call, op, args, session, payload)
            self._seq += 1
            write_message(self._view, REQUEST_AT, self._seq, header, data)
            if early:
                mark_early(self._view, self._seq)
            self._sent_at = time.perf_counter()
            os.eventfd_write(self._requests, 1)
            self._call, self._request = call, (op, args, session, payload)
            return call

    def source_ready(self, call: Call[Any]) -> None:
        """The bytes early ``call`` copies from are in place: ring once more (the daemon waits for this
        ring to copy, and to answer; a lane closed or given up meanwhile gets it too, harmlessly)."""
        with self._fd_lock:
            if not self._closed:
                os.eventfd_write(self._requests, 1)
        if self._call is call:
            self._sent_at = time.perf_counter()  # the reply's wait for the copy is not the daemon's

    @property
    def busy(self) -> bool:
        return self._call is not None

    def in_flight(self) -> list[Call[Any]]:
        return [] if self._call is None else [self._call]

    def abandon(self, call: Call[Any]) -> None:
        if self._call is call:
            self._call = None
            self.usable = False

    def wait(self, call: Call[Any], timeout: float | None = None) -> None:
        """Until ``call``'s reply is in the region; :class:`DaemonTimeout` after ``timeout`` s (the lane is
        then given up), :class:`NoDaemon` as soon as the daemon is found gone (its pidfd polls readable, or the
        session's watch says so). Threads wait one at a time: whoever reads the reply resolves the call."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            if not call.done and self._busy_poll.worth_it():
                self._poll_busily(self._busy_poll.window)
            while not call.done:
                left = deadline - time.monotonic()
                slice_ms = max(1, int(min(left, PROBE_EVERY) * 1000))
                ready = {fd for fd, _ in self._poll.poll(slice_ms)} if left > 0 and not self._watch.lost else set()
                if self._replies in ready:
                    with contextlib.suppress(BlockingIOError):  # the fd is non-blocking (the daemon's side)
                        os.eventfd_read(self._replies)
                    seq, header, payload = read_message(self._view, REPLY_AT)
                    if seq == self._seq and self._call is call:
                        self._resolve(call, header, payload)
                    elif is_closed(self._view):  # the daemon let the lane go without answering
                        self._call, self.usable = None, False
                        self._resend(call, *self._request)
                    continue  # else a ring for an earlier reply
                # a pidfd that polls readable: the daemon exited, no reply can come, whoever listens now
                gone = self._watch.exited(call.op) if self._pidfd in ready else self._watch.check(call.op)
                if gone is None and time.monotonic() < deadline:
                    continue
                self._call, self.usable = None, False
                raise no_reply(self.daemon, limit, call.op) if gone is None else gone

    def _poll_busily(self, seconds: float) -> None:
        """Until the reply eventfd is readable or ``seconds`` have passed (each poll releases the GIL)."""
        until = time.perf_counter() + seconds
        poll = self._poll.poll
        while not poll(0) and time.perf_counter() < until:
            pass

    def _resend(self, call: Call[Any], op: str, args: dict[str, Any], session: str | None,
                payload: Sequence[Any]) -> Call[Any]:
        """Send ``call``'s request on the socket and resolve ``call`` with that reply (the daemon closes a
        lane only when the session ends or it stops: the reply says so)."""
        sent = self._socket.send(op, args, session, payload, into=call.into, reach=call.reach)
        try:
            result, frames = sent.result()
        except CuctxError as error:
            call._resolve(None, [], error)
        else:
            call._resolve(result, frames, None)
        return call

    def _resolve(self, call: Call[Any], header: bytes, payload: bytes | None) -> None:
        self._call = None
        self._busy_poll.observe(time.perf_counter() - self._sent_at)
        reply = parse_reply(header)
        frames: list[Any] = []
        if payload is not None:
            if call.into is not None:
                view = memoryview(call.into).cast("B")
                size = min(len(payload), view.nbytes)
                view[:size] = payload[:size]
                frames.append(size)
            else:
                frames.append(payload)
        error = None if reply.error is None else error_from_wire(reply.error, call.op)
        call._resolve(reply.result, frames, error)

    def close(self) -> None:
        """Unmap and close the eventfds (the daemon closes its side with the session)."""
        with self._fd_lock:
            if self._closed:
                return
            self._closed = True  # under the client's route lock: no call is being sent
        self.usable = False
        self._call = None
        self._poll.unregister(self._replies)
        self._view.release()
        self._region.close()
        for fd in (self._requests, self._replies, self._pidfd):
            if fd is not None:
                os.close(fd)


class ShmLanes:
    """A session's shm lanes by device, each opened on first use by ``open_lane(device)`` (None: none to
    be had there; not asked again)."""

    def __init__(self, open_lane: Callable[[int], ShmTransport | None]) -> None:
        self._open_lane = open_lane
        self._lanes: dict[int, ShmTransport | None] = {}
        self._opening = False

    def for_device(self, device: int) -> ShmTransport | None:
        """The usable lane to ``device``, opened now if need be (None while one is being opened: the
        request that opens it takes the socket)."""
        if device not in self._lanes:
            if self._opening:
                return None
            self._opening = True
            try:
                self._lanes[device] = self._open_lane(device)
            finally:
                self._opening = False
        lane = self._lanes[device]
        return lane if lane is not None and lane.usable else None

    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(device for device, _ in self.opened()))

    def opened(self) -> list[tuple[int, ShmTransport]]:
        """The lanes opened so far, by device (usable or not)."""
        return [(device, lane) for device, lane in self._lanes.items() if lane is not None]

    def close(self) -> None:
        for lane in self._lanes.values():
            if lane is not None:
                lane.close()
        self._lanes.clear()
