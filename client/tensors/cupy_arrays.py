"""CuPy on top of :mod:`cuctxd.client.tensors.tensor_sets`: publish a dict of arrays once, load it zero-copy anywhere.

``publish_arrays(client, name, arrays)`` takes CuPy (or numpy) arrays; ``load_arrays(client, name)``
gives a :class:`LoadedArrays` whose ``arrays`` are CuPy arrays over the daemon's memory (cuda backend)
or numpy arrays over the shared bytes (sim), valid while it is open (``with``). CuPy is imported only
when these are called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import TensorSet, open_tensors
from cuctxd.protos.records import ShareDescriptor


def publish_arrays(client: Client, name: str, arrays: Mapping[str, Any], metadata: Mapping[str, Any] | None = None,
                   *, device: int | None = None) -> ShareDescriptor:
    """Publish ``arrays`` (C-contiguous CuPy arrays on the buffer's GPU, or host arrays) as ``name``."""
    return publish_tensors(client, name, dict(arrays), metadata, device=device)


class LoadedArrays:
    """The arrays published as one name, over the daemon's memory until :meth:`close`."""

    def __init__(self, tensors: TensorSet) -> None:
        self.tensors = tensors
        self.metadata = tensors.metadata
        if tensors.share.backend == "cuda":
            import cupy

            # CuPy's arrays are writable whatever the flag says: writable=False is the caller's promise there
            self.arrays = {key: cupy.asarray(shared.cuda_interface(readonly=False)) for key, shared in tensors.items()}
        else:
            import numpy

            self.arrays = {key: numpy.asarray(shared) for key, shared in tensors.items()}

    def close(self) -> None:
        """Unmap: the arrays must not be used afterwards."""
        self.arrays.clear()
        self.tensors.close()

    def __enter__(self) -> LoadedArrays:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_arrays(client: Client, name: str, *, writable: bool = False) -> LoadedArrays:
    """Map the arrays published as ``name`` (read-only views unless ``writable``, where the consumer honours it)."""
    return LoadedArrays(open_tensors(client, name, writable=writable))
