"""Client-side streams and events, named after CUDA's; handles are scoped to the session.

:class:`Stream`/:class:`Event` belong to a :class:`~cuctxd.client.client.Client`;
:class:`AsyncStream`/:class:`AsyncEvent` to an
:class:`~cuctxd.client.async_client.AsyncClient`, and their methods are coroutines.
Both flavours send the same requests (:mod:`cuctxd.client.requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cuctxd.client import requests
from cuctxd.client.objects import docs_from

if TYPE_CHECKING:
    from cuctxd.client.async_client import AsyncClient
    from cuctxd.client.client import Client


@dataclass(frozen=True)
class HandleFields:
    """What a stream or event holds: its client, its session-scoped handle, and its device."""

    client: Any = field(repr=False, compare=False)
    handle: int
    device: int


class Stream(HandleFields):
    """A CUDA stream in the context that was current on ``device`` when it was made."""

    client: Client

    def query(self) -> bool:
        """True when all queued work is done (``cuStreamQuery``)."""
        return self.client._run(requests.stream_query(self))

    def synchronize(self) -> None:
        self.client._run(requests.stream_synchronize(self))

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (``cuStreamWaitEvent``)."""
        self.client._run(requests.stream_wait_event(self, event))

    def destroy(self) -> None:
        self.client._run(requests.destroy_stream(self))


class Event(HandleFields):
    """A CUDA event; ``timing=False`` events cannot measure elapsed time."""

    client: Client

    def record(self, stream: Stream | None = None) -> None:
        """``cuEventRecord`` on ``stream`` (default: the legacy default stream)."""
        self.client._run(requests.record_event(self, stream))

    def query(self) -> bool:
        return self.client._run(requests.event_query(self))

    def synchronize(self) -> None:
        self.client._run(requests.event_synchronize(self))

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event's record to ``end``'s."""
        return self.client._run(requests.event_elapsed_time(self, end))

    def destroy(self) -> None:
        self.client._run(requests.destroy_event(self))


@docs_from(Stream)
class AsyncStream(HandleFields):
    """A :class:`Stream` of an :class:`~cuctxd.client.async_client.AsyncClient`: its methods are coroutines."""

    client: AsyncClient

    async def query(self) -> bool:
        return await self.client._run(requests.stream_query(self))

    async def synchronize(self) -> None:
        await self.client._run(requests.stream_synchronize(self))

    async def wait_event(self, event: AsyncEvent) -> None:
        await self.client._run(requests.stream_wait_event(self, event))

    async def destroy(self) -> None:
        await self.client._run(requests.destroy_stream(self))


@docs_from(Event)
class AsyncEvent(HandleFields):
    """An :class:`Event` of an :class:`~cuctxd.client.async_client.AsyncClient`: its methods are coroutines."""

    client: AsyncClient

    async def record(self, stream: AsyncStream | None = None) -> None:
        await self.client._run(requests.record_event(self, stream))

    async def query(self) -> bool:
        return await self.client._run(requests.event_query(self))

    async def synchronize(self) -> None:
        await self.client._run(requests.event_synchronize(self))

    async def elapsed_time(self, end: AsyncEvent) -> float:
        return await self.client._run(requests.event_elapsed_time(self, end))

    async def destroy(self) -> None:
        await self.client._run(requests.destroy_event(self))
