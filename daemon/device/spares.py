"""Spares: the device allocations of freed versions, kept for their name's next version.

A trainer that publishes a version every step would otherwise create, export, map and release one allocation
per version, and every engine import and map it (milliseconds each for gigabytes). Instead, when a version's
share is freed while its name still has a live version, its allocation becomes the name's spare (at most one per
name, :mod:`cuctxd.daemon.registry.versions` says which), and ``alloc`` with ``version_of`` hands it back for the
name's next version, with the same buffer id, so processes that kept their mapping of it map nothing new.

Owned by the device's worker thread, as part of its :class:`~cuctxd.daemon.device.sharing.Sharing`. Only VMM
allocations are kept (one allocation of its own per buffer, freed with any context of the device current).
A spare keeps the context reference its share held (the primary's, or a created context's place in
``context.shares``) until it is reused or released. Its bytes count where the freed version's did: against its
publisher's uid, as an orphan's (``max_orphaned_bytes_per_uid``; over it, spares go first). Never scrubbed:
its bytes are an older version of the same name, handed only to a session that may publish the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import MemoryKind, SessionContext, Share
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.versions import Spare


@dataclass(eq=False)
class SpareBuffer:
    """A spare allocation on this device: what the book knows (``spare``), and its memory."""

    spare: Spare
    #: The share id it was exported as last: its context keeps it in ``context.shares`` while spare.
    share_id: str
    ptr: int
    context: SessionContext
    kind: MemoryKind

    @property
    def footprint(self) -> int:
        return self.kind.footprint(self.spare.size)


class Spares:
    """This device's spares, by name (worker thread only)."""

    def __init__(self, device: int, current: CurrentContext, registry: ShareRegistry,
                 release_context: Callable[[SessionContext, str], None],
                 charge: Callable[[int | None, int], None]) -> None:
        """``release_context(context, share_id)``: the context's reference for ``share_id`` goes (as when a share
        is freed); ``charge(uid, bytes)``: add (or, negative, give back) bytes to the uid's orphaned tally."""
        self.device = device
        self.current = current
        self.registry = registry
        self._release_context = release_context
        self._charge = charge
        self.by_name: dict[str, SpareBuffer] = {}
        #: Allocations handed back for a next version since the start (each one not created, exported or mapped).
        self.reused = 0

    def keep(self, share: Share, names: list[str]) -> bool:
        """Before ``share``, which nothing keeps alive any more, is forgotten: keep its allocation as the spare of
        the versioned name it holds a version of (``names``) if that name has another live version and no spare;
        True if kept (the share's context reference stays with the spare)."""
        if share.descriptor.mechanism != "vmm" or len(names) != 1 or not share.descriptor.buffer_id:
            return False
        name = names[0]
        spare = Spare(share.descriptor.buffer_id, self.device, share.descriptor.size, share.owner)
        if name in self.by_name or not self.registry.keep_spare(name, spare, share.share_id):
            return False
        self.by_name[name] = SpareBuffer(spare, share.share_id, share.ptr, share.context, share.kind)
        self._charge(spare.owner.uid, share.footprint)
        return True

    def take(self, name: str) -> SpareBuffer | None:
        """The spare of ``name`` on this device, no longer kept (the caller makes it a session's buffer and calls
        :meth:`handed_over`); None where this device has none."""
        found = self.by_name.pop(name, None)
        if found is not None:
            self._charge(found.spare.owner.uid, -found.footprint)
        return found

    def handed_over(self, found: SpareBuffer) -> None:
        """A taken spare is a session's buffer now (in that session's context): its old context reference goes."""
        self.reused += 1
        self._release_context(found.context, found.share_id)

    def release(self, name: str) -> None:
        """Free ``name``'s spare here (no scrub: see the module docstring), if this device has one."""
        found = self.take(name)
        if found is None:
            return
        self.current.activate(found.context)
        found.kind.free(found.ptr)
        self._release_context(found.context, found.share_id)

    def release_stale(self) -> None:
        """Free the spares the registry no longer names as their name's (the name's last version went, or its
        next version was allocated elsewhere or of another size)."""
        for name, found in list(self.by_name.items()):
            if not self.registry.is_spare(name, found.spare.buffer_id):
                self.release(name)

    def release_of_uid(self, uid: int | None) -> bool:
        """Free one spare whose bytes count against ``uid`` (over ``max_orphaned_bytes_per_uid``); False if none."""
        name = next((name for name, found in self.by_name.items() if found.spare.owner.uid == uid), None)
        if name is None:
            return False
        self.registry.drop_spare(name, self.by_name[name].spare.buffer_id)
        self.release(name)
        return True

    def release_all(self) -> None:
        """At the daemon's stop: spares are not parked (PROTOCOL.md, "Versions"); each is freed."""
        for name in list(self.by_name):
            self.registry.drop_spare(name, self.by_name[name].spare.buffer_id)
            self.release(name)

    def status(self) -> dict[str, Any]:
        """``status``'s ``spares`` of this device: how many, their bytes, and how many were reused so far."""
        return {"count": len(self.by_name), "bytes": sum(found.footprint for found in self.by_name.values()),
                "reused": self.reused}
