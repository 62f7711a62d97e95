"""This process's mappings of ``"vmm"`` shares, shared by every client and opening in it: one import per allocation.

The first ``open_shared`` of a VMM allocation in this process asks the daemon for its fd (``pool_fd``) and
imports and maps it (:class:`~cuctxd.client.data_plane.ipc_cuda.CudaVmmMapping`,
:class:`~cuctxd.client.data_plane.ipc_sim.SimVmmMapping`: about 1.3 ms on an H100, 3 ms for 7 GiB). Every
further opening while it is mapped takes a reference on that mapping (:meth:`VmmImports.reuse`, before its
``open_shared``, so the mapping cannot go meanwhile) and asks for no fd: its ``open_shared`` only adds the
session's hold.

Keyed by (buffer id, device UUID): a buffer id names one device allocation (128 random bits, never given to
another; PROTOCOL.md, "Versions"), the same while later versions of a name reuse it, so a mapping never serves
other memory. A descriptor without one (an older daemon's) is keyed by its share id.

What is kept. The last opening's close unmaps, unless the allocation is a buffer of a versioned name N (a live
version or N's spare): those mappings are *kept*, so that N's next versions, which the daemon puts in the same
allocations, are opened without an fd, an import or a map. A kept mapping stays while (a) its buffer id is among
N's ``buffers`` as the daemon last said (every ``lookup``, ``open_shared``, versioned ``publish`` and ``alloc``
with ``version_of`` reply about N says them) and (b) this process holds an opening of some version of N, or a
still-open client of this process published a version of N (a trainer); at most :data:`KEPT_PER_NAME` per name,
the least recently used going first. It goes when either ends. This is safe: a kept mapping is never handed out
without an open version (an opening needs the daemon's hold of the share that is in it now), and it keeps only
memory the daemon itself still keeps and counts as N's (a VMM allocation lives while any process maps it) except
for the moment between the daemon releasing a spare and this process's next reply about N.

Any thread.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cuctxd.client.data_plane.openings import Opening
from cuctxd.protos.errors import NotShareable
from cuctxd.protos.records import ShareDescriptor

#: Kept mappings (mapped, no opening) per versioned name: the previous version's buffer and the spare.
KEPT_PER_NAME = 2


def _import(descriptor: ShareDescriptor, fd: int) -> Any:
    if descriptor.backend == "sim":
        from cuctxd.client.data_plane.ipc_sim import SimVmmMapping

        return SimVmmMapping(descriptor, fd)
    if descriptor.backend == "cuda":
        from cuctxd.client.data_plane.ipc_cuda import CudaVmmMapping

        return CudaVmmMapping(descriptor, fd)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")


def _key(descriptor: ShareDescriptor) -> tuple[str, str]:
    return descriptor.buffer_id or descriptor.share_id, descriptor.device_uuid


def _versioned(descriptor: ShareDescriptor) -> str | None:
    """The versioned name whose version ``descriptor`` is, or None."""
    return descriptor.name if descriptor.version and descriptor.name else None


@dataclass(eq=False)
class _Mapped:
    mapping: Any
    openings: int = 0
    #: The versioned name whose buffer it is (None: unmapped with its last opening).
    name: str | None = None
    #: When it was last opened or closed (:meth:`VmmImports._tick`), for the least recently used.
    used: int = 0


@dataclass(eq=False)
class _Name:
    """What this process knows of one versioned name."""

    buffers: frozenset[str] = frozenset()
    #: Openings of its versions in this process.
    openings: int = 0
    #: Clients of this process that published a version of it.
    publishers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


class VmmImports:
    """Mapped VMM allocations by (buffer id, device UUID), with how many openings use each, and the mappings
    kept of versioned names' buffers; see the module docstring. Counters say how often an opening was served
    by a mapping already here (``reused``) and how often one was made (``imported``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[tuple[str, str], _Mapped] = {}
        self._names: dict[str, _Name] = {}
        self._clock = itertools.count(1)
        self.reused = 0
        self.imported = 0

    def reuse(self, descriptor: ShareDescriptor) -> Opening | None:
        """One more opening of the allocation's mapping where this process maps it already (kept or open), else
        None (then open it with its fd and :meth:`map`). Close the opening if the ``open_shared`` that follows
        fails."""
        key = _key(descriptor)
        name = _versioned(descriptor)
        with self._lock:
            dropped = self._told(name, descriptor.buffers) if name is not None else []
            shared = self._mapped.get(key)
            if shared is not None:
                self._open(shared, key, name)
                self.reused += 1
        _close_all(dropped)
        return None if shared is None else Opening(self, key, shared.mapping)

    def map(self, descriptor: ShareDescriptor, fd: int | None) -> Opening:
        """Import and map the allocation from ``fd`` (closed here); where another thread mapped it meanwhile, an
        opening of that mapping instead (this one is unmapped again)."""
        if fd is None:
            raise NotShareable(f"share {descriptor.share_id} is VMM memory, mapped from its fd: open it with a "
                               "session that has the fd channel (ipc://, same host)")
        try:
            mapping = _import(descriptor, fd)
        finally:
            os.close(fd)
        key = _key(descriptor)
        name = _versioned(descriptor)
        with self._lock:
            self.imported += 1
            dropped = self._told(name, descriptor.buffers) if name is not None else []
            shared = self._mapped.setdefault(key, _Mapped(mapping))
            self._open(shared, key, name)
        if shared.mapping is not mapping:
            dropped.append(mapping)
        _close_all(dropped)
        return Opening(self, key, shared.mapping)

    def lease(self, buffer_id: str) -> tuple[Opening, str] | None:
        """An opening of the allocation ``buffer_id`` where this process maps it (a trainer writing the next
        version into a buffer it mapped before), and its device's UUID; else None."""
        with self._lock:
            key = next((key for key in self._mapped if key[0] == buffer_id), None)
            if key is None:
                return None
            shared = self._mapped[key]
            self._open(shared, key, shared.name)
            self.reused += 1
        return Opening(self, key, shared.mapping), key[1]

    def publishing(self, client: Any, name: str, buffers: Iterable[str]) -> None:
        """``client`` publishes versions of ``name``, whose buffers are ``buffers`` now (its ``alloc`` with
        ``version_of`` or ``publish`` reply): the mappings of them it makes are kept while it is open."""
        with self._lock:
            self._names.setdefault(name, _Name()).publishers.add(client)
            dropped = self._told(name, buffers)
        _close_all(dropped)

    def closed(self, client: Any) -> None:
        """``client`` was closed: the mappings kept because it published a name's versions go, unless this process
        still holds a version of the name."""
        with self._lock:
            dropped = []
            for name, known in list(self._names.items()):
                if client in known.publishers:
                    known.publishers.discard(client)
                    dropped += self._trim(name)
        _close_all(dropped)

    def told(self, name: str, buffers: Iterable[str]) -> None:
        """The daemon said ``name``'s buffers are ``buffers``: kept mappings of others go."""
        with self._lock:
            dropped = self._told(name, buffers)
        _close_all(dropped)

    def unmap(self, key: tuple[str, str]) -> None:
        """One opening fewer; the last one unmaps (on the cuda backend: ``cuMemUnmap``, ``cuMemAddressFree``,
        ``cuMemRelease``) unless the mapping is kept (module docstring)."""
        with self._lock:
            shared = self._mapped[key]
            shared.openings -= 1
            shared.used = next(self._clock)
            name = shared.name
            if name is not None and name in self._names:
                self._names[name].openings -= 1
            dropped = [] if shared.openings else self._unused(key, shared)
            if name is not None:
                dropped += self._trim(name)
        _close_all(dropped)

    def kept(self, name: str) -> int:
        """The mappings of ``name``'s buffers kept with no opening (for tests and benchmarks)."""
        with self._lock:
            return sum(1 for shared in self._mapped.values() if shared.name == name and not shared.openings)

    # --- under the lock ----------------------------------------------------------------------------------------

    def _open(self, shared: _Mapped, key: tuple[str, str], name: str | None) -> None:
        """One more opening; the mapping is a buffer of ``name``, or, where None, of the versioned name whose
        buffers list it (a trainer's mapping of the buffer its next version goes into)."""
        shared.openings += 1
        shared.used = next(self._clock)
        if name is None:
            name = shared.name or next((known for known, state in self._names.items() if key[0] in state.buffers),
                                       None)
        if name is not None:
            shared.name = name
            self._names.setdefault(name, _Name()).openings += 1

    def _unused(self, key: tuple[str, str], shared: _Mapped) -> list[Any]:
        """The mapping's last opening closed: kept if its name's rules say so, else unmapped (returned)."""
        if shared.name is not None and self._keeps(shared.name, key[0]):
            return []
        del self._mapped[key]
        return [shared.mapping]

    def _keeps(self, name: str, buffer_id: str) -> bool:
        known = self._names.get(name)
        if known is None or buffer_id not in known.buffers:
            return False
        return known.openings > 0 or any(client.has_session for client in known.publishers)

    def _told(self, name: str, buffers: Iterable[str]) -> list[Any]:
        self._names.setdefault(name, _Name()).buffers = frozenset(buffers)
        return self._trim(name)

    def _trim(self, name: str) -> list[Any]:
        """The kept mappings of ``name`` its rules no longer keep, and beyond :data:`KEPT_PER_NAME` the least
        recently used, taken out of the table (the caller unmaps them outside the lock)."""
        kept = sorted(((shared.used, key) for key, shared in self._mapped.items()
                       if shared.name == name and not shared.openings), reverse=True)
        dropped = []
        for index, (_, key) in enumerate(kept):
            if index >= KEPT_PER_NAME or not self._keeps(name, key[0]):
                dropped.append(self._mapped.pop(key).mapping)
        known = self._names.get(name)
        if known is not None and not known.openings and not known.publishers and not any(
                shared.name == name for shared in self._mapped.values()):
            del self._names[name]
        return dropped


def _close_all(mappings: list[Any]) -> None:
    """Unmap each (outside the lock: ``cuMemUnmap`` takes a while)."""
    for mapping in mappings:
        mapping.close()


#: The process's VMM mappings: an allocation is mapped once whichever client opens it.
VMM_IMPORTS = VmmImports()
