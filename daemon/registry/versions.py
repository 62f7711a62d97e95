"""The versions of versioned names (PROTOCOL.md, section 9, "Versions"): which share holds each live version.

A name published with ``version`` gets the next number (1 for the first); its previous current version
loses the name but lives on while sessions hold it open (the lifetime rule of
:mod:`cuctxd.daemon.registry.shares`), and is forgotten here when its share is freed. The numbers of a
name go on from its highest while any of its versions lives, so a holder of version 3 never sees a
"newer" version 1. No lock of its own: the :class:`~cuctxd.daemon.registry.shares.ShareRegistry`
calls every method under its lock.

A name may have one *spare*: the device allocation of a version freed while the name still had a live one,
kept by its device's worker (:mod:`cuctxd.daemon.device.spares`) for the name's next version instead of being
released. This book says which allocation is each name's spare; a spare the book no longer names (the name's
last version went, or its next version took another size or device) is released by its worker. Its old bytes
are the name's own older version, so it is handed, unscrubbed, only to a session that may publish the name's
next version (:meth:`~cuctxd.daemon.registry.shares.ShareRegistry.claim_spare`).
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cuctxd.daemon.registry.sessions import SessionRef

#: What a version was published with (the registry's Naming), kept as given.
N = TypeVar("N")


@dataclass
class _Name(Generic[N]):
    """One versioned name: its highest number, its current one (0: none, it was unpublished) and each live
    version's share id and naming."""

    latest: int = 0
    current: int = 0
    live: dict[int, tuple[str, N]] = field(default_factory=dict)
    spare: Spare | None = None


@dataclass(frozen=True)
class Spare:
    """A name's spare allocation as the book knows it: its buffer id, device and size, and who published the
    version it held (whose uid pays for it)."""

    buffer_id: str
    device: int
    size: int
    owner: SessionRef


class VersionBook(Generic[N]):
    """Every versioned name's live versions (called under the share registry's lock)."""

    def __init__(self) -> None:
        self._names: dict[str, _Name[N]] = {}
        #: Share id -> the (name, number) versions it holds.
        self._of_share: dict[str, set[tuple[str, int]]] = {}

    def add(self, name: str, share_id: str, naming: N, number: int | None = None, *, current: bool = True) -> int:
        """Record ``share_id`` as a version of ``name``: the next number (or ``number``, one re-adopted at
        start), made current if ``current``; returns its number."""
        entry = self._names.setdefault(name, _Name())
        number = entry.latest + 1 if number is None else number
        entry.latest = max(entry.latest, number)
        entry.live[number] = (share_id, naming)
        if current:
            entry.current = number
        self._of_share.setdefault(share_id, set()).add((name, number))
        return number

    def current(self, name: str) -> int:
        """The number of ``name``'s current version; 0 where it has none (not versioned, or unpublished)."""
        entry = self._names.get(name)
        return 0 if entry is None else entry.current

    def uncurrent(self, name: str) -> None:
        """``name`` no longer names its current version (unpublished, or about to name the next one)."""
        entry = self._names.get(name)
        if entry is not None:
            entry.current = 0

    def find(self, name: str, number: int) -> tuple[str, N] | None:
        """The share id and naming of version ``number`` of ``name`` while it lives."""
        entry = self._names.get(name)
        return None if entry is None else entry.live.get(number)

    def renamed(self, name: str, number: int, naming: N) -> None:
        """Live version ``number`` of ``name`` carries ``naming`` from now on (its digest, computed by the daemon)."""
        share_id, _ = self._names[name].live[number]
        self._names[name].live[number] = (share_id, naming)

    def of_share(self, share_id: str) -> list[tuple[str, int, N, bool]]:
        """Each (name, number, naming, current) version ``share_id`` holds, in name order."""
        found = []
        for name, number in sorted(self._of_share.get(share_id, ())):
            entry = self._names[name]
            found.append((name, number, entry.live[number][1], entry.current == number))
        return found

    def keep_spare(self, name: str, spare: Spare, leaving: str) -> bool:
        """Record ``spare``, the allocation of share ``leaving`` (about to be freed), as ``name``'s spare if the
        name has a live version in another share and no spare yet."""
        entry = self._names.get(name)
        if entry is None or entry.spare is not None or all(held == leaving for held, _ in entry.live.values()):
            return False
        entry.spare = spare
        return True

    def spare(self, name: str) -> Spare | None:
        """``name``'s spare, if it has one."""
        entry = self._names.get(name)
        return None if entry is None else entry.spare

    def drop_spare(self, name: str) -> Spare | None:
        """``name`` has no spare any more (taken for its next version, or to be released); returns it."""
        entry = self._names.get(name)
        if entry is None:
            return None
        spare, entry.spare = entry.spare, None
        return spare

    def live_shares(self, name: str) -> list[str]:
        """The share ids of ``name``'s live versions, oldest first."""
        entry = self._names.get(name)
        return [] if entry is None else [entry.live[number][0] for number in sorted(entry.live)]

    def gone(self, share_id: str) -> None:
        """The share was freed: its versions are forgotten (and a name without live versions with them)."""
        for name, number in self._of_share.pop(share_id, ()):
            entry = self._names[name]
            entry.live.pop(number, None)
            if entry.current == number:
                entry.current = 0
            if not entry.live:
                del self._names[name]
