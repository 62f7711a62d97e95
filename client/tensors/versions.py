"""Weights that change: each publish of a name is its next version (PROTOCOL.md, section 9, "Versions").

A trainer calls :func:`publish_version` after each step; engines hold the version they opened
(:func:`~cuctxd.client.tensors.tensor_sets.open_tensors` says its ``.version``), wait for a newer one with
:func:`wait_version` (the daemon answers when it is published) and move to it with ``.refresh()``, zero-copy
(:func:`~cuctxd.client.tensors.torch_weights.swap_parameters`) or copied into their own parameters
(``copy_into``). An older version stays mapped and valid while any process holds it and is freed when the
last holder closes it. Which thread may call: the client's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cuctxd.client.tensors.tensor_sets import publish_tensors


def publish_version(client: Any, name: str, tensors: Any, metadata: Mapping[str, Any] | None = None, *,
                    device: int | None = None, progress: Callable[[int, int], None] | None = None,
                    read_only: bool = False, digest: bool = True) -> int:
    """Publish ``tensors`` (name -> CUDA array, host buffer or :class:`RawBytes`; or a torch module or state
    dict) as the next version of ``name`` and return its number: 1 for the first, then 2, 3, ...

    CUDA tensors on the daemon's device are copied device to device in this process into a new daemon buffer
    mapped here (one request to allocate, one to map, one to publish; never through the host); host ones go
    through the data plane, hashed meanwhile. The version becomes current in one step once all of it is
    written; until then, and if this process dies on the way, the previous version stays current and the new
    buffer is freed with the session. The daemon then keeps the version by its name (this session lets go of
    the buffer), persistent, with a digest of its own where every tensor came from host memory."""
    if isinstance(tensors, Mapping) and not (tensors and _is_torch(tensors)):
        source: Mapping[str, Any] = tensors
    else:
        from cuctxd.client.tensors.torch_weights import publishable

        source = publishable(tensors)
    published = publish_tensors(client, name, source, metadata, device=device, progress=progress,
                                read_only=read_only, digest=digest, version=True)
    return published.version


def _is_torch(tensors: Mapping[str, Any]) -> bool:
    """Whether the values are torch tensors (told apart without importing torch)."""
    return type(next(iter(tensors.values()))).__module__.startswith("torch")


def wait_version(client: Any, name: str, after: int, timeout: float | None = None) -> int:
    """Block until ``name`` has a version newer than ``after`` and return its number (the daemon answers when
    it is published, no polling here); :class:`~cuctxd.protos.errors.TimedOut` after ``timeout`` seconds."""
    number: int = client.wait_version(name, after, timeout)
    return number


async def wait_version_async(client: Any, name: str, after: int, timeout: float | None = None) -> int:
    """:func:`wait_version` for an :class:`~cuctxd.client.api.async_client.AsyncClient`."""
    number: int = await client.wait_version(name, after, timeout)
    return number


__all__ = ["publish_version", "wait_version", "wait_version_async"]
