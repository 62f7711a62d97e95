"""Records that travel inside results: devices, contexts, buffers.

Each is a frozen dataclass with ``to_wire``/``from_wire`` so daemon and client
agree on the map's keys in one place.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R", bound="_Record")


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


class _Record:
    def to_wire(self) -> dict[str, Any]:
        """The record as a map; records are flat, so this is shallow (``asdict`` deep-copies, slowly)."""
        return {name: getattr(self, name) for name in _names(type(self))}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[R], wire: dict[str, Any]) -> R:
        names = _names(cls)  # type: ignore[arg-type]
        return cls(**{k: v for k, v in wire.items() if k in names})


@dataclass(frozen=True)
class DeviceInfo(_Record):
    """What ``cuDeviceGet*`` reports about one device."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessor_count: int

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> DeviceInfo:
        record = super().from_wire(wire)
        major, minor = record.compute_capability
        return dataclasses.replace(record, compute_capability=(int(major), int(minor)))


@dataclass(frozen=True)
class ContextRecord(_Record):
    """A context as the session sees it; ``handle`` is scoped to the session."""

    handle: int
    device: int
    is_primary: bool
    api_version: int
    flags: int
    context_id: int


@dataclass(frozen=True)
class BufferRecord(_Record):
    """A device allocation as the session sees it; ``handle`` is scoped to the session."""

    handle: int
    device: int
    size: int
    context: int
    shareable: bool = False


@dataclass(frozen=True)
class ShareDescriptor(_Record):
    """Everything another process needs to map a shared buffer: plain data, picklable.

    ``mechanism`` says how to map it. ``"pool"``: the buffer lives in an IPC-capable
    pool; the opener imports that pool (``pool_id``, unique per daemon run) once per
    process through the fd channel, then the buffer from ``export_data`` (the 64 bytes
    of ``cuMemPoolExportPointer``). ``"vmm"``: the buffer is a VMM allocation of its own
    (``cuMemCreate``) of ``allocation_size`` bytes; the opener gets its fd through the fd
    channel, imports it (``cuMemImportFromShareableHandle``) and maps it whole. ``"ipc"``:
    ``ipc_handle`` is the backend's legacy 64-byte handle (``CUipcMemHandle`` for cuda), the
    fallback where neither serves.
    ``host`` and ``device_uuid`` let the opener check it is on the same machine and GPU.
    ``manifest`` (from ``lookup`` of a name published with one): the packed layout of the tensors in
    the buffer (:mod:`cuctxd.protos.layouts`).
    ``publisher`` (from ``lookup``): who exported it, a map of ``session``, ``client``,
    ``pid`` and ``uid`` (None where the daemon does not know).
    ``read_only`` (from ``lookup``): the name was published read-only: map it without write access.
    ``version`` (from ``publish`` and ``lookup`` of a versioned name): the version's number, 1 for the first;
    0 where the name has no versions.
    ``buffer_id``: a random 128-bit id (hex) of the device allocation behind the share, the same while later
    versions of a name reuse it, never given to another allocation. ``buffers`` (replies about a versioned
    name): the ids of the name's buffers now, its live versions' and its spare's (PROTOCOL.md, "Versions").
    """

    share_id: str
    device: int
    device_uuid: str
    size: int
    backend: str
    ipc_handle: bytes
    host: str
    mechanism: str = "ipc"
    pool_id: str = ""
    export_data: bytes = b""
    allocation_size: int = 0
    manifest: bytes = b""
    name: str | None = None
    publisher: dict[str, Any] | None = None
    read_only: bool = False
    version: int = 0
    buffer_id: str = ""
    buffers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.buffers, tuple):  # msgpack gives a list
            object.__setattr__(self, "buffers", tuple(self.buffers))
