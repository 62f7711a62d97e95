"""Names kept in sorted order, so that a page of them costs O(log n + page), not O(n).

``list_shared`` pages through the published names on the front thread (:mod:`cuctxd.daemon.registry.shares`);
sorting or filtering every name there would stall every session behind it. Names live in chunks of at most
``2 * CHUNK`` sorted strings, found by bisecting the chunks' last names: adding or removing a name moves at
most one chunk's and one index's worth of pointers. Not thread-safe: its owner's lock guards it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, MutableSet

#: Names per chunk after a split (a chunk splits past twice this).
CHUNK = 512


class SortedNames(MutableSet[str]):
    """A set of strings iterated in code point order (UTF-8 byte order)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._chunks: list[list[str]] = []
        #: The last (largest) name of each chunk, to bisect.
        self._lasts: list[str] = []
        self._len = 0
        for name in names:
            self.add(name)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        at = bisect_left(self._lasts, name)
        if at == len(self._lasts):
            return False
        chunk = self._chunks[at]
        index = bisect_left(chunk, name)
        return index < len(chunk) and chunk[index] == name

    def __iter__(self) -> Iterator[str]:
        for chunk in self._chunks:
            yield from chunk

    def add(self, name: str) -> None:
        if not self._chunks:
            self._chunks.append([name])
            self._lasts.append(name)
            self._len = 1
            return
        at = min(bisect_left(self._lasts, name), len(self._lasts) - 1)
        chunk = self._chunks[at]
        index = bisect_left(chunk, name)
        if index < len(chunk) and chunk[index] == name:
            return
        chunk.insert(index, name)
        self._len += 1
        self._lasts[at] = chunk[-1]
        if len(chunk) > 2 * CHUNK:
            self._chunks[at:at + 1] = [chunk[:CHUNK], chunk[CHUNK:]]
            self._lasts[at:at + 1] = [chunk[CHUNK - 1], chunk[-1]]

    def discard(self, name: str) -> None:
        at = bisect_left(self._lasts, name)
        if at == len(self._lasts):
            return
        chunk = self._chunks[at]
        index = bisect_left(chunk, name)
        if index == len(chunk) or chunk[index] != name:
            return
        del chunk[index]
        self._len -= 1
        if chunk:
            self._lasts[at] = chunk[-1]
        else:
            del self._chunks[at], self._lasts[at]

    def clear(self) -> None:
        self._chunks, self._lasts, self._len = [], [], 0

    def from_name(self, start: str, *, inclusive: bool) -> Iterator[str]:
        """The names from ``start`` on (``inclusive``) or after it, in order; the set must not change while
        the iterator is used."""
        find = bisect_left if inclusive else bisect_right
        at = find(self._lasts, start)
        if at == len(self._chunks):
            return
        chunk = self._chunks[at]
        yield from chunk[find(chunk, start):]
        for later in range(at + 1, len(self._chunks)):
            yield from self._chunks[later]
