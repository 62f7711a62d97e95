"""A shared buffer opened in this process: :class:`OpenedShare`.

Opening tells the daemon this session holds the share (so it stays alive),
then maps it here: a device pointer with the cuda backend, a host memoryview
of the same bytes with the sim backend. Nothing is copied through the daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protos.errors import NotShareable
from protos.host import host_identity
from protos.records import ShareDescriptor

if TYPE_CHECKING:
    from client.client import Client


def check_same_host(descriptor: ShareDescriptor) -> None:
    if descriptor.host != host_identity():
        raise NotShareable(
            f"share {descriptor.share_id} lives on {descriptor.host}; IPC mappings only work on the "
            f"same host (this is {host_identity()})"
        )


class OpenedShare:
    """A mapped share; close it (or use ``with``) to unmap and drop the daemon's hold."""

    def __init__(self, client: Client, descriptor: ShareDescriptor, mapping: Any) -> None:
        self.client = client
        self.descriptor = descriptor
        self._mapping = mapping
        self.closed = False

    @property
    def size(self) -> int:
        return self.descriptor.size

    @property
    def device(self) -> int:
        return self.descriptor.device

    @property
    def backend(self) -> str:
        return self.descriptor.backend

    @property
    def ptr(self) -> int:
        """The device pointer in this process (cuda backend only)."""
        if self.backend != "cuda":
            raise NotShareable("a sim share has no device pointer; use host_view()")
        return int(self._mapping.ptr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of the CUDA array interface: a flat ``uint8`` array of ``size`` bytes."""
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None}

    def host_view(self) -> memoryview:
        """The shared bytes themselves (sim backend only)."""
        if self.backend != "sim":
            raise NotShareable("a cuda share lives in device memory; use ptr or __cuda_array_interface__")
        view: memoryview = self._mapping.view
        return view

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._mapping.close()
        finally:
            self.client.close_shared(self.descriptor)

    def __enter__(self) -> OpenedShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_share(descriptor: ShareDescriptor) -> Any:
    """Map a share in this process with its backend's IPC mechanism."""
    check_same_host(descriptor)
    if descriptor.backend == "sim":
        from client.ipc_sim import SimMapping

        return SimMapping(descriptor)
    if descriptor.backend == "cuda":
        from client.ipc_cuda import CudaMapping

        return CudaMapping(descriptor)
    raise NotShareable(f"share {descriptor.share_id} comes from unknown backend {descriptor.backend!r}")
