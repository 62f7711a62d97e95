"""The client's side of the wire: one DEALER socket, request ids, timeouts.

Thread-safe: a lock serialises calls, since a ZeroMQ socket belongs to one
thread at a time. Replies whose id does not match the call in flight (late
answers to calls that timed out) are discarded, so a timeout never makes a later
call read someone else's answer.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from protos.errors import ConnectionLost, CuctxError, DaemonTimeout, error_from_wire
from protos.messages import encode_request, parse_reply

#: Seconds a call waits for its reply unless the client is told otherwise.
DEFAULT_TIMEOUT = 30.0


class Transport:
    """A connection to one daemon endpoint."""

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def call(
        self,
        op: str,
        args: dict[str, Any],
        session: str | None,
        payload: Sequence[Any] = (),
        *,
        into: Any = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and wait for its reply: ``(result, payload frames)``.

        ``into``: a writable buffer that receives the reply's first payload frame
        directly (``recv_into``), so large reads land where the caller wants them.
        Raises the typed :class:`~protos.errors.CuctxError` the daemon reported,
        :class:`DaemonTimeout` after ``timeout`` seconds, :class:`ConnectionLost` once closed.
        """
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise ConnectionLost("the client is closed", op)
            request_id = next(self._ids)
            header = encode_request(request_id, op, session, args)
            if payload:
                self._socket.send_multipart([header, *payload], copy=False)
            else:
                self._socket.send(header)
            return self._await(request_id, op, limit, into)

    def _await(self, request_id: int, op: str, limit: float, into: Any) -> tuple[dict[str, Any], list[Any]]:
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise DaemonTimeout(f"no reply from {self.endpoint} within {limit:g} s", op)
            header = self._socket.recv()
            frames: list[Any] = []
            while self._socket.rcvmore:
                if into is not None and not frames:
                    frames.append(self._socket.recv_into(into))
                else:
                    frames.append(self._socket.recv(copy=False))
            try:
                reply = parse_reply(header)
            except CuctxError:
                continue  # not a reply of ours; keep waiting for the real one
            if reply.id != request_id:
                continue  # a late reply to a call that already timed out
            if reply.error is not None:
                raise error_from_wire(reply.error, op)
            assert reply.result is not None
            return reply.result, frames

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._socket.close()
