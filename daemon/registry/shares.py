"""The daemon-wide index of shared buffers and their published names.

Each share's own record (:class:`cuctxd.daemon.device.entries.Share`) lives on its device's
worker thread; this index lets the front look names up and list shares without asking a worker.

Lifetime rule (PROTOCOL.md, "Sharing"): a share is kept alive by its owner
(until the owner frees the buffer or its session ends), by every open hold,
and by its published names while its owner is gone and nobody has consumed it
yet. An explicit ``free`` unpublishes the buffer's names; a session that ends
leaves its published buffers behind for the sessions that open them (the
producer may exit first). The memory is freed once nothing keeps it alive. A
published buffer whose owner is gone and that nobody opens is freed after the
daemon's ``orphan_ttl``, so abandoned names cannot pile up outside every quota.
"""

from __future__ import annotations

import threading
from collections.abc import MutableSet
from dataclasses import dataclass
from typing import Any, Protocol

from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.errors import NameExists, NotFound, NotOwner
from cuctxd.protos.records import ShareDescriptor


class ShareRecord(Protocol):
    """What the index reads of a device's share record (:class:`cuctxd.daemon.device.entries.Share`).

    The record belongs to its device's worker thread; only that thread passes it here.
    """

    @property
    def share_id(self) -> str: ...
    @property
    def descriptor(self) -> ShareDescriptor: ...
    @property
    def owner(self) -> SessionRef: ...
    @property
    def owner_present(self) -> bool: ...
    @property
    def holders(self) -> dict[str, int]: ...
    @property
    def names(self) -> MutableSet[str]: ...


@dataclass
class _Listing:
    descriptor: ShareDescriptor
    owner: int
    owner_token: str
    holders: int = 0
    owner_present: bool = True


class ShareRegistry:
    """Every live share and published name, daemon-wide.

    Shared by the front (lookups, listings, unpublish) and the device workers
    (which create, update and end shares); every method takes the one lock, and
    no method calls out while holding it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shares: dict[str, _Listing] = {}
        self._names: dict[str, str] = {}

    def add(self, share: ShareRecord) -> None:
        with self._lock:
            self._shares[share.share_id] = _Listing(share.descriptor, share.owner.public_id, share.owner.token)

    def publish(self, name: str, share: ShareRecord) -> None:
        with self._lock:
            if name in self._names:
                raise NameExists(f"the name {name!r} is already published")
            self._names[name] = share.share_id
        share.names.add(name)

    def unpublish(self, name: str, owner_token: str) -> str:
        """Remove ``name`` if ``owner_token``'s session published it; returns its share id."""
        with self._lock:
            share_id = self._names.get(name)
            if share_id is None:
                raise NotFound(f"no buffer is published as {name!r}")
            if self._shares[share_id].owner_token != owner_token:
                raise NotOwner(f"{name!r} was published by another session")
            del self._names[name]
            return share_id

    def drop_names(self, share: ShareRecord) -> None:
        with self._lock:
            for name in share.names:
                self._names.pop(name, None)
        share.names.clear()

    def update(self, share: ShareRecord) -> None:
        with self._lock:
            listing = self._shares.get(share.share_id)
            if listing is not None:
                listing.holders = sum(share.holders.values())
                listing.owner_present = share.owner_present

    def remove(self, share: ShareRecord) -> None:
        with self._lock:
            self._shares.pop(share.share_id, None)
            for name in share.names:
                self._names.pop(name, None)

    def lookup(self, name: str) -> ShareDescriptor:
        with self._lock:
            share_id = self._names.get(name)
            if share_id is None:
                raise NotFound(f"no buffer is published as {name!r}")
            descriptor = self._shares[share_id].descriptor
        return ShareDescriptor(**{**descriptor.to_wire(), "name": name})

    def device_of(self, share_id: str) -> int:
        with self._lock:
            listing = self._shares.get(share_id)
            if listing is None:
                raise NotFound("no such shared buffer (never exported, or already freed)")
            return listing.descriptor.device

    def published(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "name": name,
                    "share_id": share_id,
                    "device": self._shares[share_id].descriptor.device,
                    "size": self._shares[share_id].descriptor.size,
                    "owner": self._shares[share_id].owner,
                    "owner_present": self._shares[share_id].owner_present,
                    "holders": self._shares[share_id].holders,
                }
                for name, share_id in sorted(self._names.items())
            ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._shares)
