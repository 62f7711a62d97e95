"""Client-side objects named after CUDA's: :class:`Context` and :class:`Buffer`.

They are thin: each holds the session-scoped handle the daemon gave out and
calls back into its :class:`~client.client.Client`; the daemon holds the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protos.records import BufferRecord, ContextRecord, ShareDescriptor

if TYPE_CHECKING:
    from client.client import Client
    from client.streams import Stream


@dataclass(frozen=True)
class Context:
    """A CUDA context as this session names it (``handle`` means nothing to other sessions)."""

    client: Client = field(repr=False, compare=False)
    handle: int
    device: int
    is_primary: bool
    api_version: int
    flags: int
    context_id: int

    @classmethod
    def from_wire(cls, client: Client, wire: dict[str, Any]) -> Context:
        record = ContextRecord.from_wire(wire)
        return cls(client, record.handle, record.device, record.is_primary, record.api_version,
                   record.flags, record.context_id)

    def push(self) -> None:
        """``cuCtxPushCurrent``: make this the session's current context on its device."""
        self.client.push_context(self)

    def destroy(self) -> None:
        """``cuCtxDestroy``: frees every buffer allocated in it."""
        self.client.destroy_context(self)

    def info(self) -> Context:
        """Fresh ``api_version``/``flags``/``device`` as the driver reports them now."""
        return self.client.context_info(self)


@dataclass
class Buffer:
    """Device memory owned by this session; freed by :meth:`free` or when the session ends."""

    client: Client = field(repr=False)
    handle: int
    device: int
    size: int
    context: int
    shareable: bool = False
    freed: bool = False

    @classmethod
    def from_wire(cls, client: Client, wire: dict[str, Any]) -> Buffer:
        record = BufferRecord.from_wire(wire)
        return cls(client, record.handle, record.device, record.size, record.context, record.shareable)

    def write(self, data: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Copy host bytes (any buffer-protocol object) to ``self[offset:]``; returns bytes written."""
        return self.client.write(self, data, offset, stream=stream)

    def read(self, size: int | None = None, offset: int = 0, *, stream: Stream | None = None) -> bytes:
        """Copy ``size`` bytes (default: to the end) from ``self[offset:]`` to the host."""
        return self.client.read(self, size, offset, stream=stream)

    def read_into(self, out: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Read ``len(out)`` bytes straight into a writable host buffer; returns bytes read."""
        return self.client.read_into(self, out, offset, stream=stream)

    def fill(self, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> None:
        """``cuMemsetD8`` over ``[offset, offset+size)`` (async on ``stream`` if given)."""
        self.client.fill(self, value, offset, size, stream=stream)

    def copy_to(self, dst: Buffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0, *,
                stream: Stream | None = None) -> int:
        """Device-to-device copy into ``dst`` (any device); returns bytes copied."""
        return self.client.copy(self, dst, size, src_offset, dst_offset, stream=stream)

    def export(self) -> ShareDescriptor:
        """Make this buffer shareable with other processes (see ``Client.open_shared``)."""
        return self.client.export(self)

    def publish(self, name: str) -> ShareDescriptor:
        return self.client.publish(self, name)

    def free(self) -> None:
        if not self.freed:
            self.client.free(self)
            self.freed = True

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
