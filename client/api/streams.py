"""Client-side streams and events, named after CUDA's; handles are scoped to the session.

:class:`Stream`/:class:`Event` belong to a :class:`~cuctxd.client.api.client.Client`;
:class:`AsyncStream`/:class:`AsyncEvent` to an
:class:`~cuctxd.client.api.async_client.AsyncClient`, and their methods are coroutines.
Both flavours send the same requests (:mod:`cuctxd.client.wire.build`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from cuctxd.client.api.objects import SessionObject
from cuctxd.client.data_plane.owner import AsyncOwner, Owner, SyncOwner
from cuctxd.client.presentation import docs_from
from cuctxd.client.wire import build


class HandleFields(SessionObject):
    """What a stream or event holds: its client, its handle, its device and the handle of its context,
    as ``create_stream``/``create_event`` answer them."""

    __slots__ = ("context",)

    #: The reply field that holds the handle: ``stream`` or ``event``.
    reply_field: ClassVar[str]

    def __init__(self, client: Owner, handle: int, device: int, context: int) -> None:
        self.client = client
        self.handle = handle
        self.device = device
        self.context = context

    @classmethod
    def from_wire(cls, client: Owner, result: dict[str, Any]) -> Self:
        return cls(client, result[cls.reply_field], result["device"], result["context"])

    def _fields(self) -> dict[str, Any]:
        return {"handle": self.handle, "device": self.device, "context": self.context}


class Stream(HandleFields):
    """A CUDA stream in the context that was current on ``device`` when it was made."""

    __slots__ = ()
    reply_field = "stream"
    client: SyncOwner

    def query(self) -> bool:
        """True when all queued work is done (``cuStreamQuery``)."""
        return self.client.run(build.stream_query(self))

    def synchronize(self) -> None:
        self.client.run(build.stream_synchronize(self))

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (``cuStreamWaitEvent``)."""
        self.client.run(build.stream_wait_event(self, event))

    def destroy(self) -> None:
        self.client.run(build.destroy_stream(self))


class Event(HandleFields):
    """A CUDA event; ``timing=False`` events cannot measure elapsed time."""

    __slots__ = ()
    reply_field = "event"
    client: SyncOwner

    def record(self, stream: Stream | None = None) -> None:
        """``cuEventRecord`` on ``stream`` (default: the legacy default stream)."""
        self.client.run(build.record_event(self, stream))

    def query(self) -> bool:
        return self.client.run(build.event_query(self))

    def synchronize(self) -> None:
        self.client.run(build.event_synchronize(self))

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event's record to ``end``'s."""
        return self.client.run(build.event_elapsed_time(self, end))

    def destroy(self) -> None:
        self.client.run(build.destroy_event(self))


@docs_from(Stream)
class AsyncStream(HandleFields):
    """A :class:`Stream` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: its methods are coroutines."""

    __slots__ = ()
    reply_field = "stream"
    client: AsyncOwner

    async def query(self) -> bool:
        return await self.client.run(build.stream_query(self))

    async def synchronize(self) -> None:
        await self.client.run(build.stream_synchronize(self))

    async def wait_event(self, event: AsyncEvent) -> None:
        await self.client.run(build.stream_wait_event(self, event))

    async def destroy(self) -> None:
        await self.client.run(build.destroy_stream(self))


@docs_from(Event)
class AsyncEvent(HandleFields):
    """An :class:`Event` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: its methods are coroutines."""

    __slots__ = ()
    reply_field = "event"
    client: AsyncOwner

    async def record(self, stream: AsyncStream | None = None) -> None:
        await self.client.run(build.record_event(self, stream))

    async def query(self) -> bool:
        return await self.client.run(build.event_query(self))

    async def synchronize(self) -> None:
        await self.client.run(build.event_synchronize(self))

    async def elapsed_time(self, end: AsyncEvent) -> float:
        return await self.client.run(build.event_elapsed_time(self, end))

    async def destroy(self) -> None:
        await self.client.run(build.destroy_event(self))
