"""Tensor-parallel checkpoints: one layout per rank (PROTOCOL.md, section 9, "Copies on several devices").

vLLM's ``sharded_state`` format writes each tensor-parallel rank's weights as its own files,
``model-rank-{r}-part-{p}.safetensors``. :func:`load_ranks` publishes each rank's parts as one layout,
``NAME/rank-R`` (:func:`rank_name`), on the device given for that rank (by default rank R on device R, modulo
the daemon's devices), so that each rank's process, on its own GPU, opens its own with :func:`open_rank`. A
node holds every rank or none: the ranks this call published are unpublished again when a later one fails.
Which thread may call: the client's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.tensors.checkpoints import read_rank, tensor_parallel_ranks
from cuctxd.client.tensors.safetensors_load import Loaded, load_checkpoint
from cuctxd.client.tensors.tensor_sets import TensorSet, open_tensors
from cuctxd.protos.errors import BadArgument


def rank_name(name: str, rank: int) -> str:
    """The layout of tensor-parallel rank ``rank`` of ``name``."""
    return f"{name}/rank-{rank}"


def load_ranks(client: Client, path: str, name: str, *, devices: Sequence[int] | None = None,
               progress: Callable[[int, int], None] | None = None, read_only: bool = False,
               replace: bool = False) -> list[Loaded]:
    """Publish each rank of the ``sharded_state`` directory ``path`` as :func:`rank_name` on ``devices[rank]``
    (default: rank R on device R modulo the daemon's devices); one :class:`Loaded` per rank, by rank (each as
    :func:`~cuctxd.client.tensors.safetensors_load.load_safetensors` says). :class:`BadArgument` for a
    directory that is not one, or ``devices`` not one per rank."""
    ranks = tensor_parallel_ranks(path)
    if not ranks:
        raise BadArgument(f"{path}: not a directory of tensor-parallel ranks (model-rank-R-part-P.safetensors)")
    if devices is None:
        count = len(client.devices())
        devices = [rank % count for rank in ranks]
    elif len(devices) != len(ranks):
        raise BadArgument(f"{path}: {len(ranks)} tensor-parallel ranks need {len(ranks)} devices, one per rank, "
                          f"in rank order; {len(devices)} given")
    checkpoints = {rank: read_rank(path, files) for rank, files in ranks.items()}  # every header checked first
    loaded: list[Loaded] = []
    try:
        for rank, checkpoint in checkpoints.items():
            loaded.append(load_checkpoint(client, checkpoint, rank_name(name, rank), device=devices[rank],
                                          progress=progress, read_only=read_only, replace=replace))
    except BaseException:
        for rank, done in enumerate(loaded):
            if done.loaded and not done.replaced:
                client.unpublish(rank_name(name, rank))
        raise
    return loaded


def open_rank(client: Client, name: str, rank: int, **options: Any) -> TensorSet:
    """Rank ``rank``'s layout of ``name`` (:func:`load_ranks`), opened as
    :func:`~cuctxd.client.tensors.tensor_sets.open_tensors` opens a layout (``options`` as it takes them)."""
    return open_tensors(client, rank_name(name, rank), **options)


__all__ = ["load_ranks", "open_rank", "rank_name"]
