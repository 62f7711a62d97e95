"""Weights that change: each publish of a name is its next version (PROTOCOL.md, section 9, "Versions").

A trainer calls :func:`publish_version` after each step; engines hold the version they opened
(:func:`~cuctxd.client.tensors.tensor_sets.open_tensors` says its ``.version``), wait for a newer one with
:func:`wait_version` (the daemon answers when it is published) and move to it with ``.refresh()``, zero-copy
(:func:`~cuctxd.client.tensors.torch_weights.swap_parameters`) or copied into their own parameters
(``copy_into``). An older version stays mapped and valid while any process holds it and is freed when the
last holder closes it. Which thread may call: the client's callers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cuctxd.client.api.async_client import AsyncClient
from cuctxd.client.api.client import Client
from cuctxd.client.api.objects import AsyncBuffer
from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.tensors.publishing import (
    checked_manifest,
    copy_through_kept,
    device_copies,
    digested,
    packed_manifest,
    plan_layout,
    publish_tensors,
)
from cuctxd.client.wire import build
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import Manifest


def publish_version(client: Client, name: str, tensors: Any, metadata: Mapping[str, Any] | None = None, *,
                    device: int | None = None, progress: Callable[[int, int], None] | None = None,
                    read_only: bool = False, digest: bool = True) -> int:
    """Publish ``tensors`` (name -> CUDA array, host buffer or :class:`RawBytes`; or a torch module or state
    dict) as the next version of ``name`` and return its number: 1 for the first, then 2, 3, ...

    CUDA tensors on the daemon's device are copied device to device in this process into the daemon buffer for
    the version, mapped here (never through the host). In steady state that buffer is the name's spare, an older
    version's allocation this process mapped before and kept mapped: one request to allocate it, the copies, one
    request to publish, and nothing allocated, exported or mapped (PROTOCOL.md, "Versions"). Host ones go
    through the data plane, hashed meanwhile. The version becomes current in one step once all of it is
    written; until then, and if this process dies on the way, the previous version stays current and the new
    buffer is freed with the session. The daemon then keeps the version by its name (this session lets go of
    the buffer), persistent, with a digest of its own: hashed here where every tensor came from host memory,
    else found by the daemon from the device once it is published (PROTOCOL.md, section 9, "Digests")."""
    published = publish_tensors(client, name, _publishable(tensors), metadata, device=device, progress=progress,
                                read_only=read_only, digest=digest, version=True)
    return published.version


async def publish_version_async(client: AsyncClient, name: str, tensors: Any,
                                metadata: Mapping[str, Any] | None = None, *, device: int | None = None,
                                read_only: bool = False, digest: bool = True) -> int:
    """:func:`publish_version` for an :class:`~cuctxd.client.api.async_client.AsyncClient`: the same requests,
    awaited (host tensors hashed on a thread while they are written, device copies made on a thread)."""
    manifest, sources, size = plan_layout(_publishable(tensors), metadata)
    packed = packed_manifest(manifest)
    checked_manifest(packed, size)
    buffer, buffer_id, buffers = await client.run(build.alloc_version(client, AsyncBuffer, size, device, name))
    VMM_IMPORTS.publishing(client, name, (*buffers, buffer_id))
    try:
        host = {index: source.host for index, source in enumerate(sources) if source.host is not None}
        hashing = asyncio.ensure_future(asyncio.to_thread(hash_views, list(host.values()))) if digest else None
        try:
            pieces = [(manifest.tensors[index].offset, view) for index, view in host.items() if view.nbytes]
            if pieces:
                await client.run(transfers.write_pieces(client, buffer, pieces))
            if any(source.device_ptr is not None for source in sources):
                await _copy_from_device(client, buffer, manifest, sources, buffer_id)
        finally:
            found = dict(zip(host, await hashing, strict=True)) if hashing is not None else {}
        packed = digested(manifest, [found.get(index) for index in range(len(sources))], packed)
        published = await client.run(build.publish(buffer, name, packed, True, read_only, version=True))
    except BaseException:
        if not buffer.freed:
            await client.free(buffer)
        raise
    VMM_IMPORTS.told(name, published.buffers)
    version: int = published.version
    return version


async def _copy_from_device(client: AsyncClient, buffer: Any, manifest: Manifest, sources: Sequence[Any],
                            buffer_id: str) -> None:
    """The device tensors into the buffer, mapped in this process: through its mapping of the allocation where
    it has one (a reused version buffer), else exported and opened (a thread makes the copies)."""
    if client.backend != "cuda":
        raise BadArgument(f"CUDA arrays cannot be copied into a {client.backend} daemon's buffer")
    from cuctxd.client.data_plane.ipc_cuda import copy_device_to_device

    if await asyncio.to_thread(copy_through_kept, buffer_id, manifest, sources):
        return
    mapped = await client.open_shared(await client.export(buffer))
    try:
        await asyncio.to_thread(copy_device_to_device, mapped.descriptor.device_uuid,
                                device_copies(manifest, sources, mapped.ptr))
    finally:
        await mapped.close()


def _publishable(tensors: Any) -> Mapping[str, Any]:
    """``tensors`` as :func:`publish_tensors` takes them: a mapping as it is, torch's through its adapter."""
    if isinstance(tensors, Mapping) and not (tensors and _is_torch(tensors)):
        return tensors
    from cuctxd.client.tensors.torch_weights import publishable

    return publishable(tensors)


def _is_torch(tensors: Mapping[str, Any]) -> bool:
    """Whether the values are torch tensors (told apart without importing torch)."""
    return type(next(iter(tensors.values()))).__module__.startswith("torch")


def wait_version(client: Client, name: str, after: int, timeout: float | None = None) -> int:
    """Block until ``name`` has a version newer than ``after`` and return its number (the daemon answers when
    it is published, no polling here); :class:`~cuctxd.protos.errors.TimedOut` after ``timeout`` seconds."""
    number: int = client.wait_version(name, after, timeout)
    return number


async def wait_version_async(client: AsyncClient, name: str, after: int, timeout: float | None = None) -> int:
    """:func:`wait_version` for an :class:`~cuctxd.client.api.async_client.AsyncClient`."""
    number: int = await client.wait_version(name, after, timeout)
    return number


__all__ = ["publish_version", "publish_version_async", "wait_version", "wait_version_async"]
