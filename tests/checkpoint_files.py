"""safetensors checkpoints written by hand for the tests: shards (a header that may be edited to lie) and
indexes, without the safetensors package."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
          np.dtype(np.uint8): "U8"}


def write_shard(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                edit: Callable[[dict[str, Any]], Any] | None = None) -> Path:
    """A safetensors file of ``tensors`` in order; ``edit(header)`` may change the header before it is written."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    data, at = b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _CODES[array.dtype], "shape": list(array.shape), "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    if edit is not None:
        edit(header)
    packed = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(packed)) + packed + data)
    return path


def write_index(path: Path, weight_map: dict[str, str], metadata: dict[str, Any] | None = None) -> Path:
    """A ``model.safetensors.index.json``: ``weight_map`` tensor -> shard file (relative to the index)."""
    path.write_text(json.dumps({"metadata": metadata or {}, "weight_map": weight_map}))
    return path


def write_raw_shard(path: Path, header: bytes, data: bytes = b"") -> Path:
    """A safetensors file whose header is ``header`` as given (hostile ones included), then ``data``."""
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def zero_size_header(count: int) -> bytes:
    """A header of ``count`` tensors of no bytes (``t0000000`` ...), about 56 bytes each."""
    entries = (b'"t%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % n for n in range(count))
    return b"{" + b",".join(entries) + b"}"


def hf_snapshot(root: Path, shards: dict[str, dict[str, np.ndarray]]) -> Path:
    """A Hugging Face cache entry under ``root``: ``blobs/`` holding the files by content, and
    ``snapshots/main/`` holding each shard and the index as a symlink into ``../../blobs``; the snapshot."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "main"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    weight_map = {}
    for number, (name, tensors) in enumerate(shards.items()):
        write_shard(blobs / f"blob{number}", tensors)
        (snapshot / name).symlink_to(f"../../blobs/blob{number}")
        weight_map.update(dict.fromkeys(tensors, name))
    write_index(blobs / "index-blob", weight_map)
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/index-blob")
    return snapshot
