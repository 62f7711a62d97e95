"""Loading a ``.safetensors`` file straight into a published layout (``cuctx load``).

The ``safetensors`` package reads and checks the format (header, dtypes,
offsets); the bytes go to the daemon through the data plane: each tensor is
copied from the file's mapping (the page cache) into the client's pinned staging
ring and DMA'd into one daemon buffer, which is then published with the file's
layout and metadata. A truncated file, or one whose header lies, is refused
before anything is published, and the buffer is freed.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

from cuctxd.client.tensors.tensor_sets import RawBytes, publish_tensors
from cuctxd.protos.errors import BadArgument, CuctxError
from cuctxd.protos.records import ShareDescriptor

#: safetensors dtype names -> layout dtype names.
_DTYPES = {"BOOL": "bool", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
           "F32": "float32", "F64": "float64", "C64": "complex64"}


def _read_header(path: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(tensors by name, metadata, where the data starts), once the safetensors package accepted the file."""
    try:
        from safetensors import safe_open
    except ImportError as missing:
        raise BadArgument(f"loading .safetensors files needs the safetensors package: {missing}") from None
    try:
        with safe_open(path, framework="numpy") as opened:
            metadata = dict(opened.metadata() or {})
            names = set(opened.keys())
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, ValueError) as exc:
        raise BadArgument(f"{path}: {exc}") from None
    except Exception as exc:
        raise BadArgument(f"{path} is not a valid safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    if set(header) != names:
        raise BadArgument(f"{path}: its header and the safetensors reader disagree on the tensors")
    return header, metadata, 8 + length


def load_safetensors(client: Any, path: str, name: str, *, device: int | None = None,
                     progress: Callable[[int, int], None] | None = None, read_only: bool = False) -> ShareDescriptor:
    """Publish the tensors of ``path`` as ``name`` (on ``device``; ``read_only``: consumers may open it
    only read-only); ``progress(done, total)`` in bytes."""
    header, metadata, start = _read_header(path)
    data_bytes = os.path.getsize(path) - start
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        data = memoryview(mapped)
        sources: dict[str, RawBytes] = {}
        try:
            for key, entry in header.items():
                dtype = _DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise BadArgument(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which layouts do not know")
                begin, end = entry["data_offsets"]
                if not 0 <= begin <= end <= data_bytes:
                    raise BadArgument(f"{path}: tensor {key!r} claims bytes {begin}..{end} of {data_bytes}: "
                                      "the file is truncated or its header lies")
                sources[key] = RawBytes(data[start + begin:start + end], dtype, tuple(entry["shape"]))
            try:
                return publish_tensors(client, name, sources, metadata, device=device, progress=progress,
                                       read_only=read_only)
            except CuctxError as error:  # its traceback's frames hold views of the mapping, which must close
                raise error.with_traceback(None) from None
        finally:
            sources.clear()
            data.release()
            # views of it may live on in a failure's traceback: the mapping then goes with them, and the
            # failure is what the caller sees (not "cannot close exported pointers exist")
            with contextlib.suppress(BufferError):
                mapped.close()


__all__ = ["load_safetensors"]
