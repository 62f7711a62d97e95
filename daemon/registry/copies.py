"""A name's copies on several devices (PROTOCOL.md, section 9, "Copies on several devices").

A name holds at most one copy per device. Each copy is a share of its own on its device's worker (its own
memory, quota, orphan accounting and parking); the :class:`~cuctxd.daemon.registry.shares.ShareRegistry`
keeps the name's *first* copy as the share the name points at (its naming, charges and index entry go with
it) and this book the others, by device. When the first copy goes (freed, revoked, evicted, unpublished on
its device) another takes its place; the name goes with its last copy.

A copy may also be *staged*: published ``stage`` by a session for a name's next ``publish`` (or ``replace``)
by that session, it is not looked up before then; that publish brings in the new first copy and every staged
one in one step under the registry's lock, so that no reader sees the old content on one device and the new
on another. Guarded by the registry's lock, like everything it indexes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K")


@dataclass(frozen=True)
class Copy:
    """One copy of a name other than its first: its share, device and, while staged, its session's token and
    what it was staged with (a :class:`~cuctxd.daemon.registry.names.Naming`, compared at the publish)."""

    name: str
    device: int
    share_id: str
    staged_by: str | None = None
    naming: object = None


class CopyBook:
    """The copies of names other than their first, and the staged ones, by name and device (registry's lock)."""

    def __init__(self) -> None:
        self._live: dict[str, dict[int, Copy]] = {}
        self._staged: dict[tuple[str, str], dict[int, Copy]] = {}
        self._of_share: dict[str, Copy] = {}

    def add(self, copy: Copy) -> None:
        """Record ``copy`` (live, or staged for its session's next publish of the name)."""
        if copy.staged_by is None:
            self._live.setdefault(copy.name, {})[copy.device] = copy
        else:
            self._staged.setdefault((copy.staged_by, copy.name), {})[copy.device] = copy
        self._of_share[copy.share_id] = copy

    def of_share(self, share_id: str) -> Copy | None:
        """The copy (live or staged) ``share_id`` is, if any."""
        return self._of_share.get(share_id)

    def live(self, name: str) -> dict[int, Copy]:
        """The name's live copies other than its first, by device."""
        return self._live.get(name, {})

    def staged(self, token: str, name: str) -> dict[int, Copy]:
        """The copies the session ``token`` staged for its next publish of ``name``, by device."""
        return self._staged.get((token, name), {})

    def drop(self, share_id: str) -> Copy | None:
        """``share_id`` is no copy any more (its name forgotten there, or its memory freed)."""
        copy = self._of_share.pop(share_id, None)
        if copy is None:
            return None
        if copy.staged_by is None:
            _discard(self._live, copy.name, copy)
        else:
            _discard(self._staged, (copy.staged_by, copy.name), copy)
        return copy

    def take_live(self, name: str) -> list[Copy]:
        """Every live copy of ``name`` but its first, forgotten here (the whole name goes, or is replaced)."""
        copies = list(self._live.pop(name, {}).values())
        for copy in copies:
            self._of_share.pop(copy.share_id, None)
        return copies

    def take_staged(self, token: str, name: str) -> list[Copy]:
        """The copies ``token`` staged for ``name``, forgotten as staged (the caller makes them live or drops them)."""
        copies = list(self._staged.pop((token, name), {}).values())
        for copy in copies:
            self._of_share.pop(copy.share_id, None)
        return copies

    def promote(self, name: str) -> Copy | None:
        """The live copy (on the lowest device) that becomes ``name``'s first now that its first went; None: none."""
        copies = self._live.get(name)
        if not copies:
            return None
        return self.drop(copies[min(copies)].share_id)


def _discard(table: dict[K, dict[int, Copy]], key: K, copy: Copy) -> None:
    copies = table.get(key)
    if copies is not None and copies.get(copy.device) == copy:
        del copies[copy.device]
        if not copies:
            del table[key]
