"""Checkpoints: a ``.safetensors`` file, a directory of shards or an index, read as one layout and checked.

:func:`read_checkpoint` resolves a path: a ``.safetensors`` file; a directory (its
``model.safetensors.index.json`` if present, else every ``*.safetensors`` in it, sorted by name); or an
index JSON given directly (``weight_map``: tensor -> shard file, relative to the index). It parses each
shard's header itself (8-byte little-endian length, then JSON, read by its grammar alone:
:mod:`~cuctxd.client.tensors.safetensors_header`; the ``safetensors`` package is not needed) and refuses,
with :class:`~cuctxd.protos.errors.BadArgument` naming the file and what is wrong, anything that would make
a load go wrong half way or cost more than a checkpoint may: a path that is not a regular file (a FIFO
would block the open forever), a truncated file, a header above ``MAX_HEADER_BYTES`` or not that JSON,
more than ``MAX_TENSORS`` tensors in all (one layout's most), a name above ``MAX_NAME_CHARS``, more than
``MAX_DIMS`` dimensions, offsets out of range, reversed, overlapping or not the tensor's size, a dtype
layouts do not know, a shard of the index that is missing or outside the index's directory, a tensor in
the index but not its shard (or in a shard but not the index), a tensor in two shards. Nothing is
allocated before it returns. Which thread may call: any (it only reads files).
"""

from __future__ import annotations

import glob
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from cuctxd.client.tensors.safetensors_header import HeaderTensor, Scalar, parse_header, parse_index
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import DTYPES, MAX_TENSORS
from cuctxd.protos.limits import MAX_HANDLE

#: The index a sharded checkpoint's directory holds (the Hugging Face convention).
INDEX_NAME = "model.safetensors.index.json"
#: Largest header a shard may have (the safetensors package's own limit).
MAX_HEADER_BYTES = 100_000_000
#: Largest index JSON read.
MAX_INDEX_BYTES = 64 << 20

#: safetensors dtype names -> layout dtype names.
SAFETENSORS_DTYPES = {"BOOL": "bool", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
                      "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                      "F32": "float32", "F64": "float64", "C64": "complex64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


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
        if tensor_parallel_ranks(path):
            raise BadArgument(f"{path}: a directory of tensor-parallel ranks (model-rank-R-part-P.safetensors): "
                              "each rank is a layout of its own (cuctx load publishes NAME/rank-R; load_ranks)")
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            raise BadArgument(f"{path}: a directory without {INDEX_NAME} or any *.safetensors file")
        return _from_shards(path, files, None)
    if path.endswith(".json"):
        return _from_index(path, path)
    return _from_shards(path, [path], None)


#: vLLM's ``sharded_state`` files: the parts of each tensor-parallel rank's weights.
RANK_PART = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")


def tensor_parallel_ranks(path: str) -> dict[int, list[str]]:
    """For a directory of vLLM ``sharded_state`` files (``model-rank-{r}-part-{p}.safetensors``, no index), each
    rank's part files in part order, by rank; ``{}`` for anything else. :class:`BadArgument` where the ranks are
    not 0..n-1."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, INDEX_NAME)):
        return {}
    parts: dict[int, list[tuple[int, str]]] = {}
    for file in sorted(os.listdir(path)):
        found = RANK_PART.fullmatch(file)
        if found is not None:
            parts.setdefault(int(found[1]), []).append((int(found[2]), os.path.join(path, file)))
    if parts and sorted(parts) != list(range(len(parts))):
        raise BadArgument(f"{path}: tensor-parallel ranks {sorted(parts)}, not 0..{len(parts) - 1}: a rank's "
                          "files are missing")
    return {rank: [file for _, file in sorted(found)] for rank, found in sorted(parts.items())}


def read_rank(path: str, files: list[str]) -> Checkpoint:
    """One tensor-parallel rank's parts (:func:`tensor_parallel_ranks`) as one checkpoint, every header checked."""
    return _from_shards(path, files, None)


def _from_index(path: str, index: str) -> Checkpoint:
    weight_map, metadata = _read_index(index)
    directory = os.path.dirname(index)
    files = {shard: _shard_path(index, directory, shard) for shard in sorted(set(weight_map.values()))}
    for shard, file in files.items():
        if not os.path.lexists(file):
            raise BadArgument(f"{index}: shard {shard!r} named in the index is missing ({file})")
    checkpoint = _from_shards(path, list(files.values()),
                              {name: files[shard] for name, shard in weight_map.items()})
    return Checkpoint(path, checkpoint.shards, checkpoint.tensors, {**checkpoint.metadata, **metadata})


def _shard_path(index: str, directory: str, shard: str) -> str:
    """Where shard file ``shard`` of the index is: a relative path without ``..`` whose folders, their
    symlinks resolved, are ``directory`` or inside it. Its own name may be a symlink to anywhere (a Hugging
    Face snapshot's files link into ``../../blobs``): what the index names must be in the directory, not
    what it links to."""
    parts = PurePosixPath(shard).parts
    if shard.startswith("/") or ".." in parts or not parts or any(ord(c) < 32 for c in shard):
        raise BadArgument(f"{index}: shard {shard!r} is not a file name in the index's directory (relative, "
                          "without '..' or control characters)")
    file = os.path.join(directory, shard)
    root, folder = os.path.realpath(directory), os.path.realpath(os.path.dirname(file))
    if os.path.commonpath([root, folder]) != root:
        raise BadArgument(f"{index}: shard {shard!r} is in {folder}, outside the index's directory {root} "
                          "(a symlinked folder)")
    return file


def _from_shards(path: str, files: list[str], weight_map: dict[str, str] | None) -> Checkpoint:
    """The shards' tensors, with ``weight_map`` (tensor -> shard path, from an index) checked against them."""
    shards: list[Shard] = []
    tensors: list[CheckpointTensor] = []
    metadata: dict[str, Any] = {}
    where: dict[str, str] = {}
    for number, file in enumerate(files):
        size, found, shard_metadata = _read_header(file, number, MAX_TENSORS - len(tensors))
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


def open_regular(path: str) -> int:
    """``path`` opened read-only (symlinks followed), :class:`BadArgument` unless it is a regular file. It is
    opened without blocking, so that a FIFO, whose open would wait for a writer forever, gets as far as the
    ``fstat`` that refuses it; a file is made blocking again. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise BadArgument(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _NOT_FILES if test(mode)), "not a file")
            raise BadArgument(f"{path}: not a regular file ({kind}): a checkpoint is read from files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _read_index(path: str) -> tuple[dict[str, str], dict[str, Scalar]]:
    """The index's ``weight_map`` and ``metadata``, read only as far as its parse gets."""
    with open(open_regular(path), "rb") as file:
        try:
            size = os.fstat(file.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise BadArgument(f"{path}: larger than {MAX_INDEX_BYTES} bytes, too large for an index")
            return parse_index(path, file.read, size)
        except OSError as exc:
            raise BadArgument(f"{path}: {exc.strerror or exc}") from None


def _read_header(path: str, shard: int, limit: int) -> tuple[int, list[CheckpointTensor], dict[str, str]]:
    """``path``'s size, tensors (by offset, at most ``limit``) and ``__metadata__``, its header checked
    against its size."""
    with open(open_regular(path), "rb") as file:
        try:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                raise BadArgument(f"{path}: truncated: {size} bytes, not even a safetensors header's length")
            said = file.read(8)
            if len(said) < 8:
                raise BadArgument(f"{path}: truncated while it was read: {len(said)} bytes")
            (length,) = struct.unpack("<Q", said)
            if length > MAX_HEADER_BYTES:
                raise BadArgument(f"{path}: a header of {length} bytes is larger than {MAX_HEADER_BYTES}: "
                                  "not a safetensors file, or a damaged one")
            if 8 + length > size:
                raise BadArgument(f"{path}: truncated: its header says {length} bytes, the file has {size - 8} "
                                  "after the length")
            entries, metadata = parse_header(path, file.read, length, limit)
        except OSError as exc:
            raise BadArgument(f"{path}: {exc.strerror or exc}") from None
    start = 8 + length
    tensors = [_tensor(path, shard, entry, start, size - start) for entry in entries]
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


def _tensor(path: str, shard: int, entry: HeaderTensor, start: int, data_bytes: int) -> CheckpointTensor:
    """One header entry, checked: a dtype layouts know, a shape whose strides fit 63 bits, offsets in the file
    that hold exactly its bytes."""
    name, shape, begin, end = entry.name, entry.shape, entry.begin, entry.end
    dtype = SAFETENSORS_DTYPES.get(entry.dtype)
    if dtype is None:
        raise BadArgument(f"{path}: tensor {name!r} has dtype {entry.dtype[:40]}, which layouts do not know "
                          f"(known: {', '.join(SAFETENSORS_DTYPES)})")
    itemsize = DTYPES[dtype].itemsize
    if math.prod(max(n, 1) for n in shape) * itemsize > MAX_HANDLE:
        raise BadArgument(f"{path}: tensor {name!r}: shape {list(shape)} spans more than 2^63 bytes")
    if begin > end:
        raise BadArgument(f"{path}: the header lies: tensor {name!r} claims bytes {begin}..{end}")
    if end > data_bytes:
        raise BadArgument(f"{path}: tensor {name!r} claims bytes {begin}..{end} of {data_bytes}: the file is "
                          "truncated or its header lies")
    nbytes = itemsize * math.prod(shape)
    if end - begin != nbytes:
        raise BadArgument(f"{path}: the header lies: tensor {name!r} of shape {shape} ({entry.dtype}) "
                          f"is {nbytes} bytes, its offsets {begin}..{end} say {end - begin}")
    return CheckpointTensor(name, dtype, shape, shard, start + begin, nbytes)


__all__ = ["INDEX_NAME", "Checkpoint", "CheckpointTensor", "Shard", "open_regular", "read_checkpoint", "read_rank",
           "tensor_parallel_ranks"]
