"""A shared buffer opened in this process: :class:`OpenedShare` and :class:`AsyncOpenedShare`.

Opening tells the daemon this session holds the share (so it stays alive),
then maps it here: a device pointer with the cuda backend, a host memoryview
of the same bytes with the sim backend. Nothing is copied through the daemon.
Mapping and unmapping are local, synchronous work; only taking and dropping the
daemon's hold are requests, so :meth:`AsyncOpenedShare.close` is a coroutine
(and ``async with`` closes it) while everything else is the same as the sync class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cuctxd.client.data_plane.owner import AsyncOwner, Owner, SyncOwner
from cuctxd.client.data_plane.pool_imports import POOL_IMPORTS
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.presentation import docs_from
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Local, Plan
from cuctxd.protos.errors import BadArgument, NotShareable, OutOfRange, WrongBackend
from cuctxd.protos.host import buffer_address, host_identity
from cuctxd.protos.records import ShareDescriptor

ShareT = TypeVar("ShareT")


def check_same_host(descriptor: ShareDescriptor) -> None:
    if descriptor.host != host_identity():
        raise NotShareable(
            f"share {descriptor.share_id} lives on {descriptor.host}; IPC mappings only work on the "
            f"same host (this is {host_identity()})"
        )


def byte_interface(ptr: int, size: int, readonly: bool) -> dict[str, Any]:
    """CUDA array interface v3 of ``size`` bytes at ``ptr``, as a flat ``uint8`` array."""
    return {"shape": (size,), "typestr": "|u1", "data": (ptr, readonly), "version": 3, "strides": None}


class MappedShare:
    """What both flavours of an opened share hold and show: the descriptor and this process's mapping."""

    def __init__(self, client: Owner, descriptor: ShareDescriptor, mapping: Any) -> None:
        self.client = client
        self.descriptor = descriptor
        self._mapping = mapping
        self.closed = False

    @property
    def size(self) -> int:
        return self.descriptor.size

    @property
    def device(self) -> int:
        return self.descriptor.device

    @property
    def backend(self) -> str:
        return self.descriptor.backend

    @property
    def ptr(self) -> int:
        """The device pointer in this process (cuda backend only; else :class:`WrongBackend`, an
        AttributeError, so ``hasattr`` says False)."""
        if self.backend != "cuda":
            raise WrongBackend(f"a {self.backend} share has no device pointer; use host_view()")
        return int(self._mapping.ptr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of the CUDA array interface: a flat ``uint8`` array of ``size`` bytes (cuda backend
        only: on others ``hasattr(share, "__cuda_array_interface__")`` is False)."""
        if self.backend != "cuda":
            raise WrongBackend(f"a {self.backend} share is host memory, not a CUDA array; use host_view()")
        return byte_interface(self.ptr, self.size, self.descriptor.read_only)

    def host_view(self) -> memoryview:
        """The shared bytes themselves (sim backend only); read-only for a share published read-only."""
        if self.backend != "sim":
            raise NotShareable("a cuda share lives in device memory; use ptr or __cuda_array_interface__")
        view: memoryview = self._mapping.view
        return view.toreadonly() if self.descriptor.read_only else view

    # Copies through this process's mapping, whatever the backend: a local copy (cuMemcpyDtoH/HtoD on the
    # cuda backend, finished before they return; a memory copy on the sim), nothing through the daemon.
    # Synchronous in both client flavours. Order them against GPU work on the share yourself (PROTOCOL.md,
    # section 9, "Opening and closing").

    def read(self, size: int | None = None, offset: int = 0) -> bytes:
        """``size`` bytes (default: to the end) from ``offset`` of the shared buffer, as bytes."""
        size = self._span(offset, size, "read")
        out = bytearray(size)
        self.read_into(out, offset)
        return bytes(out)

    def read_into(self, destination: Any, offset: int = 0) -> int:
        """Fill ``destination`` (a writable buffer: bytearray, memoryview, numpy array, a host buffer) with the
        shared bytes from ``offset``; returns how many bytes were copied (its size)."""
        with memoryview(destination) as view:
            if view.readonly:
                raise BadArgument("read_into needs a writable destination buffer")
            size = self._span(offset, view.nbytes, "read_into")
            if self.backend == "sim":
                view.cast("B")[:] = self._mapping.view[offset:offset + size]
                return size
            self._copy_with_host(view, offset, size, to_host=True)
        return size

    def write(self, data: Any, offset: int = 0) -> int:
        """Copy ``data`` (any bytes-like object) into the shared buffer at ``offset``; returns the bytes written.
        Refused (``BadArgument``) for a share published read-only."""
        if self.descriptor.read_only:
            raise BadArgument(f"{self.descriptor.name or self.descriptor.share_id!r} was published read-only")
        with memoryview(data) as view:
            size = self._span(offset, view.nbytes, "write")
            if self.backend == "sim":
                self._mapping.view[offset:offset + size] = view.cast("B")
                return size
            self._copy_with_host(view, offset, size, to_host=False)
        return size

    def _span(self, offset: int, size: int | None, what: str) -> int:
        """``size`` (default: from ``offset`` to the end), checked to lie inside the buffer."""
        if self.closed:
            raise BadArgument(f"{what}: this share is closed (unmapped)")
        if size is None:
            size = self.size - min(offset, self.size)
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfRange(f"{what}: bytes {offset}..{offset + size} reach outside the share's {self.size} bytes")
        return size

    def _copy_with_host(self, view: memoryview, offset: int, size: int, *, to_host: bool) -> None:
        if self.backend != "cuda":
            raise NotShareable(f"cannot copy with a {self.backend} share")
        from cuctxd.client.data_plane.ipc_cuda import copy_with_host

        if not view.c_contiguous:
            raise BadArgument("the host buffer must be contiguous")
        if size:
            with buffer_address(view) as address:
                copy_with_host(self.descriptor.device_uuid, self.ptr + offset, address, size, to_host=to_host)


class OpenedShare(MappedShare):
    """A mapped share; close it (or use ``with``) to unmap and drop the daemon's hold."""

    client: SyncOwner

    def close(self) -> None:
        """Unmap, then drop the daemon's hold (even if unmapping failed); nothing the second time."""
        self.client.run(close_share(self))

    def __enter__(self) -> OpenedShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@docs_from(OpenedShare)
class AsyncOpenedShare(MappedShare):
    """An :class:`OpenedShare` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: ``await share.close()``,
    or ``async with await client.open_shared(name) as share:``."""

    client: AsyncOwner

    async def close(self) -> None:
        await self.client.run(close_share(self))

    async def __aenter__(self) -> AsyncOpenedShare:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def map_share(descriptor: ShareDescriptor, pool_fd: int | None) -> Any:
    """Map a share in this process as its ``mechanism`` says: from its pool (imported from ``pool_fd``
    unless already, :mod:`cuctxd.client.data_plane.pool_imports`), its VMM allocation's fd (``pool_fd``,
    :mod:`cuctxd.client.data_plane.vmm_imports`), or with the backend's legacy IPC handle. ``pool_fd`` is
    closed here."""
    check_same_host(descriptor)
    if descriptor.mechanism == "pool":
        return POOL_IMPORTS.map(descriptor, pool_fd)
    if descriptor.mechanism == "vmm":
        return VMM_IMPORTS.map(descriptor, pool_fd)
    if descriptor.backend == "sim":
        from cuctxd.client.data_plane.ipc_sim import SimMapping

        return SimMapping(descriptor)
    if descriptor.backend == "cuda":
        from cuctxd.client.data_plane.ipc_cuda import CudaMapping

        return CudaMapping(descriptor)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")


def open_share(owner: Owner, kind: Callable[[Owner, ShareDescriptor, Any], ShareT],
               share: str | ShareDescriptor) -> Plan[ShareT]:
    """Look the share up (by name), hold it, map it here (asking for its fd: a VMM share's unless this process
    maps it already, then its mapping is reused; a pool share's when this process has not imported that pool
    yet); a failed mapping drops the hold again."""
    descriptor = (yield build.lookup(share)) if isinstance(share, str) else share
    check_same_host(descriptor)
    mapped = VMM_IMPORTS.reuse(descriptor) if descriptor.mechanism == "vmm" else None
    need_fd = (descriptor.mechanism == "vmm" and mapped is None) or (
        descriptor.mechanism == "pool" and not POOL_IMPORTS.has(descriptor.pool_id))
    try:
        plane = owner.data_plane() if need_fd else None
        descriptor, ticket = yield build.open_shared(descriptor, pool_fd=need_fd)
    except BaseException:
        if mapped is not None:
            mapped.close()
        raise
    if mapped is not None:
        return kind(owner, descriptor, mapped)
    try:
        mapping = yield Local(lambda: map_share(descriptor, plane.receive_fd(ticket) if plane and ticket else None))
    except BaseException:
        yield build.close_shared(descriptor)
        raise
    return kind(owner, descriptor, mapping)


def close_share(share: MappedShare) -> Plan[None]:
    """Unmap once, then drop the daemon's hold, even when unmapping raised."""
    if share.closed:
        return
    share.closed = True
    try:
        share._mapping.close()
    finally:
        yield build.close_shared(share.descriptor)
