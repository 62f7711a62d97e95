"""Streams and events (protocol version 1): CUDA's ordering, as first-class session objects.

A stream belongs to the context that was the session's current one on its
device when it was made; work on it runs in order, asynchronously to other
streams. Events mark points in a stream. Replies to ``*_synchronize`` ops come
when the work is done; the device's worker keeps serving other requests
meanwhile. ``fill``, ``write``, ``read`` and ``copy`` take an optional
``stream``: ``fill`` and ``copy`` then reply once queued, ``write`` and
``read`` once their bytes have moved.
"""

from __future__ import annotations

from cuctxd.protos.schema import count_field, handle_field, op


@op("create_stream", target="device")
class CreateStream:
    """Like ``cuStreamCreate`` in the session's current context (binds the primary lazily).
    Result: ``stream`` (handle), ``context`` (its context's handle), ``device`` (the device it is on)."""

    device: int | None = count_field(default=None)
    non_blocking: bool = False


@op("destroy_stream", target="device")
class DestroyStream:
    """Like ``cuStreamDestroy``; queued work still completes. Result: ``{}``."""

    stream: int = handle_field()
    device: int | None = count_field(default=None)


@op("stream_query", target="device")
class StreamQuery:
    """Like ``cuStreamQuery``. Result: ``done`` (false where CUDA says NOT_READY)."""

    stream: int = handle_field()
    device: int | None = count_field(default=None)


@op("stream_synchronize", target="device")
class StreamSynchronize:
    """Reply once all work queued on the stream so far is done. Result: ``{}``."""

    stream: int = handle_field()
    device: int | None = count_field(default=None)


@op("create_event", target="device")
class CreateEvent:
    """Like ``cuEventCreate`` in the session's current context.
    Result: ``event`` (handle), ``context`` (its context's handle), ``device`` (the device it is on)."""

    device: int | None = count_field(default=None)
    timing: bool = True


@op("destroy_event", target="device")
class DestroyEvent:
    """Like ``cuEventDestroy``. Result: ``{}``."""

    event: int = handle_field()
    device: int | None = count_field(default=None)


@op("record_event", target="device")
class RecordEvent:
    """Like ``cuEventRecord`` on ``stream`` (default: the legacy default stream). Result: ``{}``."""

    event: int = handle_field()
    stream: int | None = handle_field(default=None)
    device: int | None = count_field(default=None)


@op("event_query", target="device")
class EventQuery:
    """Like ``cuEventQuery``. Result: ``done``."""

    event: int = handle_field()
    device: int | None = count_field(default=None)


@op("event_synchronize", target="device")
class EventSynchronize:
    """Reply once the event's recorded work is done. Result: ``{}``."""

    event: int = handle_field()
    device: int | None = count_field(default=None)


@op("event_elapsed_time", target="device")
class EventElapsedTime:
    """Like ``cuEventElapsedTime`` (both events done and timed). Result: ``ms``."""

    start: int = handle_field()
    end: int = handle_field()
    device: int | None = count_field(default=None)


@op("stream_wait_event", target="device")
class StreamWaitEvent:
    """Like ``cuStreamWaitEvent``: later work on ``stream`` waits for ``event``. Result: ``{}``."""

    stream: int = handle_field()
    event: int = handle_field()
    device: int | None = count_field(default=None)
