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
daemon's ``orphan_ttl``, so abandoned names cannot pile up outside every quota;
beyond ``max_orphaned_shares`` of those, the oldest go first
(:meth:`cuctxd.daemon.device.sharing.Sharing.owner_left`).

Names have owners. ``lookup`` and ``list_shared`` say who published (session,
client name, pid, uid where known). A *scoped* name ``user/name`` may be
published only by a session whose peer runs as ``user`` (or as the daemon's own
user, or root); other names are first come, first served. A name is removed
only by the session that published it, or, once that session has let the
buffer go, by another session of the same uid.
"""

from __future__ import annotations

import os
import pwd
import threading
from collections.abc import MutableSet
from dataclasses import dataclass
from typing import Any, Protocol

from cuctxd.daemon.registry.parking import ParkingLot
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
    owner: SessionRef
    holders: int = 0
    owner_present: bool = True

    def publisher(self) -> dict[str, Any]:
        """Who exported the buffer: session id, client name, pid and uid (None where unknown)."""
        return {"session": self.owner.public_id, "client": self.owner.client, "pid": self.owner.pid,
                "uid": self.owner.uid}


@dataclass(frozen=True)
class Naming:
    """What a published name carries besides its share: the tensor layout's manifest (packed) and
    tensor count, and whether openers are to map it read-only."""

    manifest: bytes = b""
    tensors: int = 0
    read_only: bool = False

    def listed(self) -> dict[str, Any]:
        """What ``list_shared`` says of the name's layout and mode."""
        return {"tensors": self.tensors, "read_only": self.read_only}


#: A name published with nothing but its share.
PLAIN = Naming()


def check_scope(name: str, uid: int | None) -> None:
    """Refuse a scoped name ``user/...`` unless ``uid`` is that user's, the daemon's own, or root's."""
    scope, slash, _ = name.partition("/")
    if not slash:
        return
    if uid is None:
        raise NotOwner(f"{name!r} is scoped to user {scope!r}, and the daemon cannot tell which user this "
                       "session runs as (only ipc:// connections say); publish an unscoped name")
    if uid in (0, os.geteuid()):
        return
    try:
        owner_uid = pwd.getpwnam(scope).pw_uid
    except KeyError:
        owner_uid = None
    if owner_uid != uid:
        raise NotOwner(f"{name!r} is scoped to user {scope!r}; this session runs as uid {uid}")


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
        #: What each name was published with (absent: a plain name, :class:`Naming`'s defaults).
        self._namings: dict[str, Naming] = {}
        #: Ids of published shares kept alive by their names alone, on every device.
        self._orphaned: set[str] = set()
        #: Where persistent shares are parked to survive the daemon (:mod:`cuctxd.daemon.registry.parking`):
        #: set before the workers start when a service manager keeps fds, else None.
        self.parking: ParkingLot | None = None

    def add(self, share: ShareRecord) -> None:
        with self._lock:
            self._shares[share.share_id] = _Listing(share.descriptor, share.owner)

    def publish(self, name: str, share: ShareRecord, naming: Naming = PLAIN) -> None:
        """Name ``share`` (:func:`check_scope` first), with its layout (checked by the caller) and
        flags; a name is never replaced: unpublish it first."""
        check_scope(name, share.owner.uid)
        with self._lock:
            share_id = self._names.get(name)
            if share_id is not None:
                who = self._shares[share_id].owner
                raise NameExists(f"the name {name!r} is already published (by session {who.public_id}, "
                                 f"client {who.client!r}); only its publisher may unpublish it")
            self._names[name] = share.share_id
            if naming != PLAIN:
                self._namings[name] = naming
        share.names.add(name)

    def unpublish(self, name: str, caller: SessionRef) -> str:
        """Remove ``name`` if ``caller`` may (module docstring); returns its share id."""
        with self._lock:
            share_id = self._names.get(name)
            if share_id is None:
                raise NotFound(f"no buffer is published as {name!r}")
            listing = self._shares[share_id]
            owner = listing.owner
            same_user = not listing.owner_present and owner.uid is not None and owner.uid == caller.uid
            if owner.token != caller.token and not same_user:
                raise NotOwner(f"{name!r} was published by session {owner.public_id} ({owner.client!r}); "
                               "only it may unpublish the name (or, once it let the buffer go, its user)")
            self._forget_name(name)
            return share_id

    def count_orphan(self, share_id: str, orphaned: bool) -> None:
        """A device's share became (or stopped being) kept alive by its names alone."""
        with self._lock:
            if orphaned:
                self._orphaned.add(share_id)
            else:
                self._orphaned.discard(share_id)

    def orphan_count(self) -> int:
        """Published shares kept alive by their names alone, daemon-wide (``max_orphaned_shares``)."""
        with self._lock:
            return len(self._orphaned)

    def drop_names(self, share: ShareRecord) -> None:
        with self._lock:
            for name in share.names:
                self._forget_name(name)
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
            self._orphaned.discard(share.share_id)
            for name in share.names:
                self._forget_name(name)

    def _forget_name(self, name: str) -> None:
        """The name and what it was published with go (under the lock)."""
        self._names.pop(name, None)
        self._namings.pop(name, None)

    def namings(self, share: ShareRecord) -> dict[str, Naming]:
        """Each name of ``share`` with what it was published with."""
        with self._lock:
            return {name: self._namings.get(name, PLAIN) for name in share.names
                    if self._names.get(name) == share.share_id}

    def lookup(self, name: str) -> ShareDescriptor:
        """The descriptor published as ``name``, with its ``publisher``."""
        with self._lock:
            share_id = self._names.get(name)
            if share_id is None:
                raise NotFound(f"no buffer is published as {name!r}")
            listing = self._shares[share_id]
            naming = self._namings.get(name, PLAIN)
        return ShareDescriptor(**{**listing.descriptor.to_wire(), "name": name, "publisher": listing.publisher(),
                                  "manifest": naming.manifest, "read_only": naming.read_only})

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
                    **self._namings.get(name, PLAIN).listed(),
                    "name": name,
                    "share_id": share_id,
                    "device": self._shares[share_id].descriptor.device,
                    "size": self._shares[share_id].descriptor.size,
                    "owner": self._shares[share_id].owner.public_id,
                    "owner_present": self._shares[share_id].owner_present,
                    "holders": self._shares[share_id].holders,
                    "publisher": self._shares[share_id].publisher(),
                }
                for name, share_id in sorted(self._names.items())
            ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._shares)
