"""Checkpoints: a ``.safetensors`` file, a directory of shards or an index, read as one layout and checked.

:func:`read_checkpoint` resolves a path: a ``.safetensors`` file; a directory (its
``model.safetensors.index.json`` if present, else every ``*.safetensors`` in it, sorted by name); or an
index JSON given directly (``weight_map``: tensor -> shard file, relative to the index). It parses each
shard's header itself (8-byte little-endian length, then JSON; the ``safetensors`` package is not needed)
and refuses, with :class:`~cuctxd.protos.errors.BadArgument` naming the file and what is wrong, anything
that would make a load go wrong half way: a truncated file, a header too large or not JSON, offsets out of
range, reversed, overlapping or not the tensor's size, a dtype layouts do not know, a shard of the index
that is missing, a tensor in the index but not its shard (or in a shard but not the index), a tensor in two
shards. Nothing is allocated before it returns. Which thread may call: any (it only reads files).
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import DTYPES, MAX_DIMS

#: The index a sharded checkpoint's directory holds (the Hugging Face convention).
INDEX_NAME = "model.safetensors.index.json"
#: Largest header a shard may have (the safetensors package's own limit).
MAX_HEADER_BYTES = 100_000_000
#: Largest index JSON read.
MAX_INDEX_BYTES = 64 << 20

#: safetensors dtype names -> layout dtype names.
SAFETENSORS_DTYPES = {"BOOL": "bool", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
                      "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                      "F32": "float32", "F64": "float64", "C64": "complex64"}


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor: its layout dtype and shape, and its ``nbytes`` bytes at ``offset`` of shard ``shard``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Shard:
    """One file of a checkpoint, and its size when its header was read."""

    path: str
    size: int


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`read_checkpoint` found: the shards in order, the tensors by shard then by offset in it (the
    order they are laid out and read in), and the metadata (the shards' ``__metadata__``, then the index's)."""

    path: str
    shards: tuple[Shard, ...]
    tensors: tuple[CheckpointTensor, ...]
    metadata: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


def read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at ``path`` (module docstring), every shard's header checked."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            return _from_index(path, index)
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            raise BadArgument(f"{path}: a directory without {INDEX_NAME} or any *.safetensors file")
        return _from_shards(path, files, None)
    if path.endswith(".json"):
        return _from_index(path, path)
    return _from_shards(path, [path], None)


def _from_index(path: str, index: str) -> Checkpoint:
    raw = _read_small(index, MAX_INDEX_BYTES)
    try:
        decoded = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadArgument(f"{index}: the index is not JSON ({exc})") from None
    weight_map = decoded.get("weight_map") if isinstance(decoded, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise BadArgument(f"{index}: an index is a JSON object whose 'weight_map' maps tensor names to shard files")
    metadata = decoded.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BadArgument(f"{index}: the index's 'metadata' must be an object")
    directory = os.path.dirname(index)
    files = sorted(set(weight_map.values()))
    for shard in files:
        if not os.path.isfile(os.path.join(directory, shard)):
            raise BadArgument(f"{index}: shard {shard!r} named in the index is missing "
                              f"({os.path.join(directory, shard)})")
    checkpoint = _from_shards(path, [os.path.join(directory, shard) for shard in files],
                              {name: os.path.join(directory, shard) for name, shard in weight_map.items()})
    return Checkpoint(path, checkpoint.shards, checkpoint.tensors, {**checkpoint.metadata, **metadata})


def _from_shards(path: str, files: list[str], weight_map: dict[str, str] | None) -> Checkpoint:
    """The shards' tensors, with ``weight_map`` (tensor -> shard path, from an index) checked against them."""
    shards: list[Shard] = []
    tensors: list[CheckpointTensor] = []
    metadata: dict[str, Any] = {}
    where: dict[str, str] = {}
    for number, file in enumerate(files):
        size, found, shard_metadata = _read_header(file, number)
        for key, value in shard_metadata.items():
            metadata.setdefault(key, value)
        for tensor in found:
            if tensor.name in where:
                raise BadArgument(f"{path}: tensor {tensor.name!r} is in two shards, {where[tensor.name]} and {file}")
            where[tensor.name] = file
            if weight_map is not None and weight_map.get(tensor.name) != file:
                said = weight_map.get(tensor.name)
                raise BadArgument(f"{path}: tensor {tensor.name!r} is in {file} but "
                                  + ("not in the index" if said is None else f"the index puts it in {said}"))
        shards.append(Shard(file, size))
        tensors.extend(found)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in where:
                raise BadArgument(f"{path}: the index puts tensor {name!r} in {file}, which does not have it")
    return Checkpoint(path, tuple(shards), tuple(tensors), metadata)


def _read_small(path: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as file:
            raw = file.read(limit + 1)
    except OSError as exc:
        raise BadArgument(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise BadArgument(f"{path}: larger than {limit} bytes, too large for an index")
    return raw


def _read_header(path: str, shard: int) -> tuple[int, list[CheckpointTensor], dict[str, Any]]:
    """``path``'s size, tensors (by offset) and ``__metadata__``, its header checked against its size."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                raise BadArgument(f"{path}: truncated: {size} bytes, not even a safetensors header's length")
            (length,) = struct.unpack("<Q", file.read(8))
            if length > MAX_HEADER_BYTES:
                raise BadArgument(f"{path}: a header of {length} bytes is larger than {MAX_HEADER_BYTES}: "
                                  "not a safetensors file, or a damaged one")
            if 8 + length > size:
                raise BadArgument(f"{path}: truncated: its header says {length} bytes, the file has {size - 8} "
                                  "after the length")
            raw = file.read(length)
    except OSError as exc:
        raise BadArgument(f"{path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadArgument(f"{path}: the header is not JSON ({exc}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise BadArgument(f"{path}: the header is not a JSON object: not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BadArgument(f"{path}: the header's __metadata__ must be an object")
    start = 8 + length
    tensors = [_tensor(path, shard, name, entry, start, size - start) for name, entry in header.items()]
    tensors.sort(key=lambda tensor: tensor.offset)
    previous: CheckpointTensor | None = None
    for tensor in tensors:
        if not tensor.nbytes:
            continue
        if previous is not None and tensor.offset < previous.offset + previous.nbytes:
            raise BadArgument(f"{path}: the header lies: tensors {previous.name!r} and {tensor.name!r} overlap "
                              f"(bytes {previous.offset - start}..{previous.offset - start + previous.nbytes} and "
                              f"{tensor.offset - start}..{tensor.offset - start + tensor.nbytes})")
        previous = tensor
    return size, tensors, metadata


def _tensor(path: str, shard: int, name: str, entry: Any, start: int, data_bytes: int) -> CheckpointTensor:
    """One header entry, checked: known dtype, a shape, offsets in the file that hold exactly its bytes."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise BadArgument(f"{path}: header entry {name!r} is not a tensor (dtype, shape, data_offsets)")
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise BadArgument(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which layouts do not know "
                          f"(known: {', '.join(SAFETENSORS_DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise BadArgument(f"{path}: tensor {name!r}: shape {shape!r} is not a list of at most {MAX_DIMS} "
                          "non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets):
        raise BadArgument(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise BadArgument(f"{path}: the header lies: tensor {name!r} claims bytes {begin}..{end}")
    if end > data_bytes:
        raise BadArgument(f"{path}: tensor {name!r} claims bytes {begin}..{end} of {data_bytes}: the file is "
                          "truncated or its header lies")
    nbytes = DTYPES[dtype].itemsize * math.prod(shape)
    if end - begin != nbytes:
        raise BadArgument(f"{path}: the header lies: tensor {name!r} of shape {tuple(shape)} ({entry['dtype']}) "
                          f"is {nbytes} bytes, its offsets {begin}..{end} say {end - begin}")
    return CheckpointTensor(name, dtype, tuple(shape), shard, start + begin, nbytes)


__all__ = ["INDEX_NAME", "Checkpoint", "CheckpointTensor", "Shard", "read_checkpoint"]
