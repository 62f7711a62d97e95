"""One opening of a mapping that this process's openings of the same memory share: the handle
:class:`~cuctxd.client.api.sharing.MappedShare` keeps, whose :meth:`Opening.close` gives its reference back to
the table that counts them (:mod:`cuctxd.client.data_plane.pool_imports`,
:mod:`cuctxd.client.data_plane.vmm_imports`), which unmaps with the last. Any thread.
"""

from __future__ import annotations

from typing import Any, Protocol


class Openings(Protocol):
    """A table of shared mappings with how many openings use each."""

    def unmap(self, key: Any) -> None:
        """One opening of the mapping under ``key`` fewer; the last one unmaps it."""


class Opening:
    """One opening of a shared mapping: ``ptr`` (cuda) or ``view`` (sim), and :meth:`close` (once)."""

    def __init__(self, openings: Openings, key: Any, mapping: Any) -> None:
        self._openings = openings
        self._key = key
        self._mapping = mapping
        self.closed = False

    @property
    def ptr(self) -> int:
        return int(self._mapping.ptr)

    @property
    def view(self) -> memoryview:
        view: memoryview = self._mapping.view
        return view

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._openings.unmap(self._key)
