"""The published names in order, daemon-wide and by owner, so that ``list_shared`` pages cost O(log n + page).

:class:`NameIndex` keeps every name three times over in :class:`SortedNames`: all of them, those of each
publishing uid, those of each publishing session (by its public id, as ``publisher.session`` says). A page
filtered by owner walks that owner's names only; a prefix is a range of any of them. Guarded by the
:class:`~cuctxd.daemon.registry.shares.ShareRegistry`'s lock, like everything it indexes.

A session's names are those of one uid, except where a parked share adopted after a restart keeps its old
publisher's public id and a new session has the same: filtered by session and uid, the registry checks each
name's uid (:meth:`NameIndex.matching` says which names to check).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.sorted_names import SortedNames

K = TypeVar("K")


@dataclass(frozen=True)
class NameFilter:
    """Which names a page lists: those after ``after`` (exclusive), starting with ``prefix``, published by the
    session whose public id is ``session`` and by ``uid`` (None: any)."""

    after: str | None = None
    prefix: str = ""
    session: int | None = None
    uid: int | None = None


class NameIndex:
    """Names in code point order: all, by uid, by session (public id). Under the registry's lock."""

    def __init__(self) -> None:
        self._all = SortedNames()
        self._by_uid: dict[int | None, SortedNames] = {}
        self._by_session: dict[int, SortedNames] = {}

    def add(self, name: str, owner: SessionRef) -> None:
        self._all.add(name)
        self._by_uid.setdefault(owner.uid, SortedNames()).add(name)
        self._by_session.setdefault(owner.public_id, SortedNames()).add(name)

    def discard(self, name: str, owner: SessionRef) -> None:
        self._all.discard(name)
        _discard(self._by_uid, owner.uid, name)
        _discard(self._by_session, owner.public_id, name)

    def count_of_uid(self, uid: int | None) -> int:
        """Names published by sessions of ``uid`` (tcp:// peers: None), ended sessions' included."""
        names = self._by_uid.get(uid)
        return 0 if names is None else len(names)

    def matching(self, which: NameFilter) -> Iterator[str]:
        """The names ``which`` selects, in order, from the narrowest index that holds them all; with both a session
        and a uid, the session's names, whose uid the caller checks."""
        if which.session is not None:
            names = self._by_session.get(which.session)
        elif which.uid is not None:
            names = self._by_uid.get(which.uid)
        else:
            names = self._all
        if not names:
            return iter(())
        return _in_range(names, which.after, which.prefix)


def _in_range(names: SortedNames, after: str | None, prefix: str) -> Iterator[str]:
    """The names past ``after`` that start with ``prefix``: O(log n) to the first, then one step each."""
    if after is not None and after >= prefix:
        start = names.from_name(after, inclusive=False)
    else:
        start = names.from_name(prefix, inclusive=True)
    for name in start:
        if not name.startswith(prefix):
            return
        yield name


def _discard(index: dict[K, SortedNames], key: K, name: str) -> None:
    """Take ``name`` out of ``index[key]``, and the key out once it has no name left."""
    names = index.get(key)
    if names is None:
        return
    names.discard(name)
    if not names:
        del index[key]
