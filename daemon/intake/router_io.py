"""Taking requests off a ROUTER socket and putting replies on it, for the front and the device lanes.

Both the front's ROUTER and each device's own ROUTER (:mod:`cuctxd.daemon.worker.lane`) read
and write messages the same way: a message is ``[identity, header, *payload]``;
replies never block (a client that does not read loses its reply, the daemon
goes on). Flags are plain ints: pyzmq's enums cost a Python-level operation on
every use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, cast

import zmq

log = logging.getLogger(__name__)

#: Requests taken off a ROUTER per wake-up before other work gets a turn.
BATCH = 64

NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
#: Payload frames from this size up are sent zero-copy and can be tracked; pyzmq copies smaller ones.
TRACK_FROM = zmq.COPY_THRESHOLD
#: Milliseconds a ROUTER closed after a drain that finished in time keeps sending what it still queues (the
#: untracked small replies of a slow reader); the context's termination waits at most this long for them.
REPLY_LINGER_MS = 1000


def readable(socket: zmq.Socket[Any]) -> bool:
    """A message is waiting (checking EVENTS is far cheaper than a NOBLOCK recv raising Again)."""
    return bool(cast(int, socket.getsockopt(_EVENTS)) & _POLLIN)


def recv_request(router: zmq.Socket[Any]) -> tuple[bytes, bytes, list[zmq.Frame], zmq.Frame] | None:
    """The next whole message as ``(identity, header, payload frames, peer)``; :class:`zmq.Again` when
    none is waiting (one exception per batch costs less than an ``EVENTS`` check per message).

    None (logged) for a message of one frame, which has no header to answer.
    Frames are read as :class:`zmq.Frame` (their ``more`` flag is cheaper than
    ``getsockopt(RCVMORE)``); payload frames stay zero-copy all the way to the
    driver call. The header frame comes last, for its properties: who sent it
    (:func:`cuctxd.daemon.intake.peers.peer_of`, read for ``hello`` only).
    """
    first = router.recv(NOBLOCK, copy=False)
    if not first.more:
        log.warning("dropped a message of 1 frame: no header to answer")
        return None
    header_frame = router.recv(copy=False)
    payload = []
    more = header_frame.more
    while more:
        frame = router.recv(copy=False)
        payload.append(frame)
        more = frame.more
    return first.bytes, header_frame.bytes, payload, header_frame


def recv_batch(router: zmq.Socket[Any]) -> Iterator[tuple[bytes, bytes, list[zmq.Frame], zmq.Frame]]:
    """The whole messages waiting (:func:`recv_request`'s), up to :data:`BATCH` of them, then other work gets a
    turn; a message of one frame is left out (logged)."""
    for _ in range(BATCH):
        try:
            message = recv_request(router)
        except zmq.Again:
            return
        if message is not None:
            yield message


def send_reply(router: zmq.Socket[Any], frames: Sequence[Any], *, copy: bool = True) -> None:
    """Send ``[identity, header, *payload]`` without blocking; a reply nobody can take is dropped."""
    last = len(frames) - 1
    try:
        for index, frame in enumerate(frames):
            router.send(frame, _NOBLOCK_MORE if index < last else NOBLOCK, copy=copy)
    except zmq.ZMQError as exc:
        _dropped(exc)


def send_parts(router: zmq.Socket[Any], identity: bytes, header: bytes, payload: Sequence[Any] = (),
               track: bool = False) -> list[tuple[Any, int]]:
    """:func:`send_reply` for a reply built here: identity and header copied, payload frames zero-copy.

    ``track``: the ``(MessageTracker, bytes)`` of each payload frame ZeroMQ keeps without copying
    (from pyzmq's ``COPY_THRESHOLD`` up), done once ZeroMQ has let go of it; else none.
    """
    trackers: list[tuple[Any, int]] = []
    try:
        router.send(identity, _NOBLOCK_MORE)
        if not payload:
            router.send(header, NOBLOCK)
            return trackers
        router.send(header, _NOBLOCK_MORE)
        last = len(payload) - 1
        for index, frame in enumerate(payload):
            flags = _NOBLOCK_MORE if index < last else NOBLOCK
            if track and len(frame) >= TRACK_FROM:
                trackers.append((router.send(frame, flags, copy=False, track=True), len(frame)))
            else:
                router.send(frame, flags, copy=False)
    except zmq.ZMQError as exc:
        _dropped(exc)
    return trackers


def _dropped(exc: zmq.ZMQError) -> None:
    """Log a reply that could not leave; re-raise anything but a full queue or a vanished client."""
    if isinstance(exc, zmq.Again):
        log.warning("dropped a reply: the client is not reading (send queue full)")
    elif exc.errno == zmq.EHOSTUNREACH:
        log.debug("dropped a reply to a client that has gone away")
    else:
        raise exc
