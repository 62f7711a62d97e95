"""Pipelining: send many requests without waiting for each reply.

``with client.pipeline() as p:`` gives an object whose methods mirror the
client's memory ops but return :class:`~client.transport.Call` futures at once;
leaving the block waits for every reply (raising the first error). Ops on one
stream keep their order in the daemon, so a sequence of writes, copies and reads
flows without a round trip each.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from client.transport import Call
from protos.errors import CuctxError

if TYPE_CHECKING:
    from client.client import Client
    from client.objects import Buffer
    from client.streams import Stream

#: Requests in flight before the pipeline reads replies: bounded so neither side's
#: ZeroMQ queue (1,000 messages by default) can overflow.
MAX_IN_FLIGHT = 256


def _size(result: dict[str, Any], frames: list[Any]) -> int:
    return int(result["size"])


def _bytes(result: dict[str, Any], frames: list[Any]) -> bytes:
    return frames[0].bytes if frames else b""


class Pipeline:
    """Futures-returning twins of the client's memory ops; see the module docstring."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._calls: list[Call[Any]] = []

    def _send(self, op: str, payload: tuple[Any, ...] = (), convert: Any = _size, **args: Any) -> Call[Any]:
        transport = self.client._transport
        while transport.in_flight() >= MAX_IN_FLIGHT:
            oldest = next(c for c in self._calls if not c.done)
            transport.wait(oldest)
        call = self.client._send(op, payload, convert, **args)
        self._calls.append(call)
        return call

    def write(self, buffer: Buffer, data: Any, offset: int = 0, *, stream: Stream | None = None) -> Call[int]:
        return self._send("write", (data,), device=buffer.device, buffer=buffer.handle, offset=offset,
                          stream=None if stream is None else stream.handle)

    def read(self, buffer: Buffer, size: int | None = None, offset: int = 0, *,
             stream: Stream | None = None) -> Call[bytes]:
        return self._send("read", (), _bytes, device=buffer.device, buffer=buffer.handle, offset=offset,
                          size=size, stream=None if stream is None else stream.handle)

    def fill(self, buffer: Buffer, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> Call[int]:
        return self._send("fill", device=buffer.device, buffer=buffer.handle, value=value, offset=offset,
                          size=size, stream=None if stream is None else stream.handle)

    def copy(self, src: Buffer, dst: Buffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0,
             *, stream: Stream | None = None) -> Call[int]:
        return self._send("copy", device=src.device, dst_device=dst.device, src=src.handle, dst=dst.handle,
                          size=size, src_offset=src_offset, dst_offset=dst_offset,
                          stream=None if stream is None else stream.handle)

    def wait(self) -> None:
        """Wait for every reply; raise the first error (after all replies are in)."""
        first_error: BaseException | None = None
        for call in self._calls:
            try:
                call.result()
            except BaseException as exc:
                first_error = first_error or exc
        self._calls.clear()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.wait()
        else:
            for call in self._calls:  # collect replies so none is left for later calls
                with contextlib.suppress(CuctxError):  # the block's own exception is the one to see
                    call.result()
            self._calls.clear()
