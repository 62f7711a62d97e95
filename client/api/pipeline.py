"""Pipelining: send many requests without waiting for each reply.

``with client.pipeline() as p:`` gives an object whose methods mirror the
client's memory ops but return :class:`~cuctxd.client.wire.transport.Call` futures at once;
leaving the block waits for every reply (raising the first error). Ops on one
stream keep their order in the daemon, so a sequence of writes, copies and reads
flows without a round trip each.

``async with async_client.pipeline() as p:`` is the same for an
:class:`~cuctxd.client.api.async_client.AsyncClient`, its methods returning
:class:`asyncio.Task` futures (each is also simply a concurrent call; the
pipeline keeps them in order and collects them). Both flavours build their
requests in :mod:`cuctxd.client.wire.build`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Generic, TypeVar

from cuctxd.client.presentation import docs_from
from cuctxd.client.wire import build
from cuctxd.client.wire.build import OnDevice, Request
from cuctxd.client.wire.socket_transport import MAX_IN_FLIGHT
from cuctxd.client.wire.transport import Call
from cuctxd.protos.errors import CuctxError, DaemonTimeout, NoDaemon

__all__ = ["MAX_IN_FLIGHT", "AsyncPipeline", "Pipeline", "PipelineOps", "raise_first"]

#: What a pipeline's methods return: a :class:`Call` or an :class:`asyncio.Task`.
FutureT = TypeVar("FutureT")


def raise_first(outcomes: Iterable[object]) -> None:
    """Raise the first exception among results gathered with ``return_exceptions``."""
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


class PipelineOps(Generic[FutureT]):
    """The memory ops a pipeline offers, each handed to :meth:`send` as one request."""

    def send(self, request: Request[Any]) -> FutureT:
        raise NotImplementedError

    def write(self, buffer: OnDevice, data: Any, offset: int = 0, *, stream: OnDevice | None = None) -> FutureT:
        """One write request however large ``data`` is (result: bytes written)."""
        return self.send(build.write_frame(buffer, data, offset, stream))

    def read(self, buffer: OnDevice, size: int | None = None, offset: int = 0, *,
             stream: OnDevice | None = None) -> FutureT:
        """Result: the bytes."""
        return self.send(build.read_frame(buffer, size, offset, stream))

    def fill(self, buffer: OnDevice, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: OnDevice | None = None) -> FutureT:
        """Result: bytes filled."""
        return self.send(build.fill(buffer, value, offset, size, stream))

    def copy(self, src: OnDevice, dst: OnDevice, size: int | None = None, src_offset: int = 0,
             dst_offset: int = 0, *, stream: OnDevice | None = None) -> FutureT:
        """Result: bytes copied."""
        return self.send(build.copy(src, dst, size, src_offset, dst_offset, stream))


class Pipeline(PipelineOps[Call[Any]]):
    """Futures-returning twins of the client's memory ops; see the module docstring."""

    def __init__(self, send: Callable[[Request[Any]], Call[Any]]) -> None:
        """``send``: the client's, which sends a request on its route without waiting."""
        self._send = send
        self._calls: list[Call[Any]] = []

    def send(self, request: Request[Any]) -> Call[Any]:
        """Send any request now; at most :data:`MAX_IN_FLIGHT` wait for replies at once on each socket."""
        call = self._send(request)
        self._calls.append(call)
        return call

    def wait(self) -> None:
        """Wait for every reply; raise the first error (after all replies are in).

        Once the daemon is taken as gone (a reply did not come within the timeout, nothing listens at the
        endpoint, or another daemon does), the calls still open are abandoned at once, whatever error came
        first (a daemon that answers ``CUCTXD_ERROR_SHUTTING_DOWN`` and then exits, say): a batch fails within
        about one timeout, or one liveness probe, never one per call.
        """
        first_error: BaseException | None = None
        gone = False
        for call in self._calls:
            if gone:
                call.transport.abandon(call)
                continue
            try:
                call.result()
            except BaseException as exc:
                first_error = first_error or exc
                gone = isinstance(exc, (DaemonTimeout, NoDaemon))
        self._calls.clear()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.wait()
        else:
            with contextlib.suppress(CuctxError):  # the block's own exception is the one to see
                self.wait()


@docs_from(Pipeline)
class AsyncPipeline(PipelineOps["asyncio.Task[Any]"]):
    """The async client's pipeline: methods return tasks at once, sent in the order they were made;
    leaving ``async with`` (or :meth:`wait`) awaits them all and raises the first error."""

    def __init__(self, run: Callable[[Request[Any]], Coroutine[Any, Any, Any]]) -> None:
        """``run``: the client's, which awaits one request."""
        self._run = run
        self._tasks: list[asyncio.Task[Any]] = []

    def send(self, request: Request[Any]) -> asyncio.Task[Any]:
        """Start any request as a task of the running loop."""
        task = asyncio.get_running_loop().create_task(self._run(request))
        self._tasks.append(task)
        return task

    async def _collect(self) -> list[Any]:
        outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        return outcomes

    async def wait(self) -> None:
        raise_first(await self._collect())

    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        outcomes = await self._collect()  # every reply is in before the block's own exception goes on
        if exc_type is None:
            raise_first(outcomes)
