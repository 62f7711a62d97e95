"""Client-side streams and events, named after CUDA's; handles are scoped to the session."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.client import Client


@dataclass(frozen=True)
class Stream:
    """A CUDA stream in the context that was current on ``device`` when it was made."""

    client: Client = field(repr=False, compare=False)
    handle: int
    device: int

    def query(self) -> bool:
        """True when all queued work is done (``cuStreamQuery``)."""
        return bool(self.client._call("stream_query", device=self.device, stream=self.handle)["done"])

    def synchronize(self) -> None:
        self.client._call("stream_synchronize", device=self.device, stream=self.handle)

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (``cuStreamWaitEvent``)."""
        self.client._call("stream_wait_event", device=self.device, stream=self.handle, event=event.handle)

    def destroy(self) -> None:
        self.client._call("destroy_stream", device=self.device, stream=self.handle)


@dataclass(frozen=True)
class Event:
    """A CUDA event; ``timing=False`` events cannot measure elapsed time."""

    client: Client = field(repr=False, compare=False)
    handle: int
    device: int

    def record(self, stream: Stream | None = None) -> None:
        """``cuEventRecord`` on ``stream`` (default: the legacy default stream)."""
        self.client._call("record_event", device=self.device, event=self.handle,
                          stream=None if stream is None else stream.handle)

    def query(self) -> bool:
        return bool(self.client._call("event_query", device=self.device, event=self.handle)["done"])

    def synchronize(self) -> None:
        self.client._call("event_synchronize", device=self.device, event=self.handle)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event's record to ``end``'s."""
        result = self.client._call("event_elapsed_time", device=self.device, start=self.handle, end=end.handle)
        return float(result["ms"])

    def destroy(self) -> None:
        self.client._call("destroy_event", device=self.device, event=self.handle)
