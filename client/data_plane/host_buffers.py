"""Shared page-locked host memory: :class:`HostBuffer` and :class:`AsyncHostBuffer` (``client.host_alloc``).

The daemon makes the memory (a memfd it maps and registers with
``cuMemHostRegister``) and hands this process the fd through the fd channel;
both map the same pages. A host buffer *is* that mapping (an ``mmap.mmap``), so
it speaks the buffer protocol (``memoryview(hb)``, ``numpy.frombuffer(hb)``) and
``__array_interface__`` (``numpy.asarray(hb)``) without a copy. ``client.write``
from it and ``read_into`` it send only a small request: the device's worker
copies by DMA. :meth:`HostBuffer.free` (or the end of the session) frees it; it
must not be used afterwards, here or in the daemon.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Self, TypeVar

from cuctxd.client.data_plane.owner import AsyncOwner, Owner, SyncOwner
from cuctxd.client.presentation import describe, docs_from
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Local, Plan
from cuctxd.protos.host import buffer_address

HostT = TypeVar("HostT", bound="HostBufferFields")


class HostBufferFields(mmap.mmap):
    """What both flavours hold: the shared mapping itself, the daemon's handle and the device it serves (a
    staging ring's host buffer is one of these: the session's end frees it)."""

    client: Owner
    handle: int
    device: int
    #: Its bytes the daemon backed with 2 MiB pages (an ``O_DIRECT`` read into them goes in larger requests).
    huge_page_bytes: int
    freed: bool
    _address: int

    @classmethod
    def mapped(cls, client: Owner, result: dict[str, Any], fd: int) -> Self:
        """Map the daemon's memfd (``result`` is ``host_alloc``'s answer); ``fd`` is closed here."""
        try:
            self = cls(fd, int(result["size"]))
        finally:
            os.close(fd)
        self.client = client
        self.handle = int(result["host"])
        self.device = int(result["device"])
        self.huge_page_bytes = int(result.get("huge_page_bytes", 0))
        self.freed = False
        with buffer_address(self) as address:  # valid while mapped; the export ends with the block
            self._address = address
        return self

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """Version 3 of numpy's array interface: a flat, writable ``uint8`` array."""
        if self.freed:
            raise ValueError("the host buffer was freed")
        return {"shape": (len(self),), "typestr": "|u1", "data": (self._address, False), "version": 3}

    def __repr__(self) -> str:
        return describe(type(self).__name__, {"handle": self.handle, "device": self.device, "size": len(self)})

    def _unmap(self) -> bool:
        """Unmap here; False if it already was. BufferError while views of it are alive (release them)."""
        if self.freed:
            return False
        try:
            self.close()
        except BufferError:
            raise BufferError("views of this host buffer (memoryview, numpy arrays) are still alive: "
                              "release them before free()") from None
        self.freed = True
        return True


class HostBuffer(HostBufferFields):
    """Host memory shared with the daemon and page-locked there; see the module docstring."""

    client: SyncOwner

    def free(self, *, wait: bool = True) -> None:
        """Unmap here, then free the daemon's side (after copies queued on streams that use it have
        passed); nothing the second time. ``wait=False``: without waiting for the daemon's answer (its
        unregistering, 15 ms for 72 MiB on the H200, delays the session's next request to the device
        instead; a failure goes unreported, and the session's end frees the buffer anyway)."""
        if self._unmap():
            self.client.run(build.host_free(self) if wait else build.unanswered(build.host_free(self)))

    def __exit__(self, *exc: object) -> None:
        self.free()


@docs_from(HostBuffer)
class AsyncHostBuffer(HostBufferFields):
    """A :class:`HostBuffer` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: ``await hb.free()``,
    or ``async with await client.host_alloc(n) as hb:``."""

    client: AsyncOwner

    async def free(self) -> None:
        if self._unmap():
            await self.client.run(build.host_free(self))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.free()


class _Handle:
    """A host buffer the daemon made but this process never mapped: enough to free it."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.handle = int(result["host"])
        self.device = int(result["device"])


def host_alloc(owner: Owner, kind: type[HostT], size: int, device: int | None, reuse: bool = False) -> Plan[HostT]:
    """Make the buffer (``reuse``: or take one the daemon kept), fetch its fd over the fd channel and map it; a
    failed mapping frees it again."""
    plane = owner.data_plane()
    result = yield build.host_alloc(device, size, reuse)
    try:
        mapped: HostT = yield Local(lambda: kind.mapped(owner, result, plane.receive_fd(result["ticket"])))
    except BaseException:
        yield build.host_free(_Handle(result))
        raise
    return mapped
