"""Helpers for tests that speak the wire protocol by hand, below the client library.

:class:`RawPeer` is one DEALER socket: it sends whatever frames a test builds
(garbage included) and receives replies with a deadline, so a test that expects
an answer fails with a message instead of hanging.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgpack
import zmq

from cuctxd.protos.messages import pack
from cuctxd.protos.version import PROTOCOL_VERSION

#: Seconds a raw peer waits for a reply it expects.
REPLY_TIMEOUT = 10.0


class RawPeer:
    """A DEALER connected to ``endpoint``; owned by the thread that made it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._ids = itertools.count(1000)

    def next_id(self) -> int:
        return next(self._ids)

    def send_frames(self, frames: Sequence[bytes]) -> None:
        self.socket.send_multipart(list(frames))

    def send(self, op: str, args: dict[str, Any] | None = None, session: str | None = None,
             payload: Sequence[bytes] = (), request_id: int | None = None) -> int:
        """Send a well-formed request; returns its id."""
        rid = self.next_id() if request_id is None else request_id
        header: dict[str, Any] = {"id": rid, "op": op}
        if session is not None:
            header["session"] = session
        if args is not None:
            header["args"] = args
        self.send_frames([pack(header), *payload])
        return rid

    def recv(self, timeout: float = REPLY_TIMEOUT) -> tuple[dict[str, Any], list[bytes]]:
        """The next reply as (decoded header, payload frames); AssertionError if none comes."""
        if not self.socket.poll(int(timeout * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply from {self.endpoint} within {timeout} s")
        header, *frames = self.socket.recv_multipart()
        decoded = msgpack.unpackb(header, raw=False)
        assert isinstance(decoded, dict), f"reply header is not a map: {decoded!r}"
        return decoded, frames

    def has_reply(self, timeout: float) -> bool:
        return bool(self.socket.poll(int(timeout * 1000), zmq.POLLIN))

    def call(self, op: str, args: dict[str, Any] | None = None, session: str | None = None,
             payload: Sequence[bytes] = ()) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request and return its reply, checking the reply carries the request's id."""
        rid = self.send(op, args, session, payload)
        header, frames = self.recv()
        assert header["id"] == rid, f"reply id {header['id']} for request {rid}"
        return header, frames

    def ok(self, op: str, args: dict[str, Any] | None = None, session: str | None = None,
           payload: Sequence[bytes] = ()) -> tuple[dict[str, Any], list[bytes]]:
        """Like :meth:`call`, but the reply must be a success: returns (result, frames)."""
        header, frames = self.call(op, args, session, payload)
        assert header["ok"] is True, f"{op} failed: {header.get('error')}"
        return header["result"], frames

    def hello(self) -> str:
        """Open a session; returns its token."""
        result, _ = self.ok("hello", {"protocol": PROTOCOL_VERSION, "client": "raw-test", "pid": 1})
        return str(result["session"])

    def close(self) -> None:
        self.socket.close()


@contextmanager
def raw_peer(endpoint: str) -> Iterator[RawPeer]:
    peer = RawPeer(endpoint)
    try:
        yield peer
    finally:
        peer.close()


def error_name(header: dict[str, Any]) -> str:
    """The error name of a failed reply; AssertionError if the reply succeeded."""
    assert header["ok"] is False, f"expected an error reply, got {header}"
    return str(header["error"]["name"])
