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
