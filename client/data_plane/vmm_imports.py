"""This process's mappings of ``"vmm"`` shares, shared by every client and opening in it: one import per share.

The first ``open_shared`` of a VMM share in this process asks the daemon for its fd (``pool_fd``) and
imports and maps the allocation (:class:`~cuctxd.client.data_plane.ipc_cuda.CudaVmmMapping`,
:class:`~cuctxd.client.data_plane.ipc_sim.SimVmmMapping`: about 1.3 ms on an H100). Every further opening
while one is open takes a reference on that mapping (:meth:`VmmImports.reuse`, before its ``open_shared``,
so the mapping cannot go meanwhile) and asks for no fd: its ``open_shared`` only adds the session's hold.
The last opening's close unmaps, before its ``close_shared``. Nothing closed is kept: a VMM allocation lives
while any process maps it, so a kept mapping would keep device memory the daemon freed (and counts as free)
with no hold of this process vouching for it.

Keyed by (share id, device UUID): a share id names one allocation for as long as it is known (128 random
bits, never reused; a parked share adopted by the next daemon keeps its id and its memory), so a mapping
never serves another share. Any thread.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cuctxd.client.data_plane.openings import Opening
from cuctxd.protos.errors import NotShareable
from cuctxd.protos.records import ShareDescriptor


def _import(descriptor: ShareDescriptor, fd: int) -> Any:
    if descriptor.backend == "sim":
        from cuctxd.client.data_plane.ipc_sim import SimVmmMapping

        return SimVmmMapping(descriptor, fd)
    if descriptor.backend == "cuda":
        from cuctxd.client.data_plane.ipc_cuda import CudaVmmMapping

        return CudaVmmMapping(descriptor, fd)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")


def _key(descriptor: ShareDescriptor) -> tuple[str, str]:
    return descriptor.share_id, descriptor.device_uuid


class VmmImports:
    """Mapped VMM shares by (share id, device UUID), with how many openings use each; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (share id, device UUID) -> [the mapping, its openings].
        self._mapped: dict[tuple[str, str], list[Any]] = {}

    def reuse(self, descriptor: ShareDescriptor) -> Opening | None:
        """One more opening of the share's mapping where this process maps it already, else None (then open it
        with its fd and :meth:`map`). Close the opening if the ``open_shared`` that follows fails."""
        key = _key(descriptor)
        with self._lock:
            shared = self._mapped.get(key)
            if shared is None:
                return None
            shared[1] += 1
        return Opening(self, key, shared[0])

    def map(self, descriptor: ShareDescriptor, fd: int | None) -> Opening:
        """Import and map the share from ``fd`` (closed here); where another thread mapped it meanwhile, an
        opening of that mapping instead (this one is unmapped again)."""
        if fd is None:
            raise NotShareable(f"share {descriptor.share_id} is VMM memory, mapped from its fd: open it with a "
                               "session that has the fd channel (ipc://, same host)")
        try:
            mapping = _import(descriptor, fd)
        finally:
            os.close(fd)
        key = _key(descriptor)
        with self._lock:
            shared = self._mapped.setdefault(key, [mapping, 0])
            shared[1] += 1
        if shared[0] is not mapping:
            mapping.close()
        return Opening(self, key, shared[0])

    def unmap(self, key: tuple[str, str]) -> None:
        """One opening fewer; the last one unmaps (on the cuda backend: ``cuMemUnmap``, ``cuMemAddressFree``,
        ``cuMemRelease``)."""
        with self._lock:
            shared = self._mapped[key]
            shared[1] -= 1
            if shared[1]:
                return
            del self._mapped[key]
        shared[0].close()


#: The process's VMM mappings: a share is mapped once whichever client opens it.
VMM_IMPORTS = VmmImports()
