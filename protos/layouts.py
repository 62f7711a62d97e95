"""Tensor layouts: many named tensors in one shared allocation, described by a manifest.

``publish`` may carry a manifest (msgpack, as ``manifest`` bytes): per tensor its
``name``, ``dtype`` (a name from :data:`DTYPES`), ``shape``, ``strides`` (in
elements, C order when omitted) and byte ``offset`` in the buffer; plus free-form
``metadata``. Optionally each tensor's ``digest`` and the layout's ``digest``
(:mod:`cuctxd.protos.digests`: what the bytes are, so a consumer can require
them). The daemon checks it against the buffer (:func:`check_manifest`)
before anything is published and hands it to every ``lookup``, so a consumer
maps all the tensors with one import. Shared by the daemon and the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from cuctxd.protos import digests
from cuctxd.protos.errors import BadArgument

#: Byte alignment of each tensor in a layout the Python client makes (at least what CUDA allocations give).
ALIGNMENT = 256
#: Largest manifest (packed) a ``publish`` may carry.
MAX_MANIFEST_BYTES = 512 << 10
#: Most tensors one layout may list.
MAX_TENSORS = 100_000
#: Most dimensions of one tensor.
MAX_DIMS = 32
#: Longest tensor name, in characters.
MAX_NAME_CHARS = 1024


@dataclass(frozen=True)
class DType:
    """An element type: its size, numpy/CUDA-array-interface ``typestr`` (None where those have none)
    and DLPack type code and bits."""

    itemsize: int
    typestr: str | None
    dlpack: tuple[int, int]


#: The element types a manifest may name (DLPack codes: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool,
#: 10 float8_e4m3fn, 12 float8_e5m2, 14 float8_e8m0fnu; names as torch spells them).
DTYPES: dict[str, DType] = {
    "bool": DType(1, "|b1", (6, 8)),
    "int8": DType(1, "|i1", (0, 8)), "int16": DType(2, "<i2", (0, 16)),
    "int32": DType(4, "<i4", (0, 32)), "int64": DType(8, "<i8", (0, 64)),
    "uint8": DType(1, "|u1", (1, 8)), "uint16": DType(2, "<u2", (1, 16)),
    "uint32": DType(4, "<u4", (1, 32)), "uint64": DType(8, "<u8", (1, 64)),
    "float16": DType(2, "<f2", (2, 16)), "float32": DType(4, "<f4", (2, 32)), "float64": DType(8, "<f8", (2, 64)),
    "bfloat16": DType(2, None, (4, 16)),
    "float8_e4m3fn": DType(1, None, (10, 8)), "float8_e5m2": DType(1, None, (12, 8)),
    "float8_e8m0fnu": DType(1, None, (14, 8)),
    "complex64": DType(8, "<c8", (5, 64)), "complex128": DType(16, "<c16", (5, 128)),
}
#: numpy/array-interface ``typestr`` -> dtype name (``=`` and ``<`` alike: little-endian hosts).
BY_TYPESTR = {d.typestr: name for name, d in DTYPES.items() if d.typestr is not None}
BY_TYPESTR.update({"<" + ts[1:]: name for ts, name in list(BY_TYPESTR.items()) if ts.startswith("|")})
BY_TYPESTR.update({"=" + ts[1:]: name for ts, name in list(BY_TYPESTR.items())})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layout; ``strides`` in elements; ``digest`` of its bytes where its publisher said."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    digest: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def extent(self) -> int:
        """One past the last byte it touches (its offset for an empty tensor)."""
        if not all(self.shape):
            return self.offset
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.offset + (last + 1) * DTYPES[self.dtype].itemsize

    def to_wire(self) -> dict[str, Any]:
        wire = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "strides": list(self.strides),
                "offset": self.offset}
        if self.digest is not None:
            wire["digest"] = self.digest
        return wire


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Manifest:
    """The tensors and metadata; ``digest``: the layout's (:func:`cuctxd.protos.digests.layout_digest` of
    its tensors), present only when every tensor has one."""

    tensors: tuple[TensorSpec, ...]
    metadata: dict[str, Any]
    digest: str | None = None

    @classmethod
    def digested(cls, tensors: tuple[TensorSpec, ...], metadata: dict[str, Any]) -> Manifest:
        """The manifest with its layout digest where every tensor has a digest (else none)."""
        if not all(t.digest is not None for t in tensors):
            return cls(tensors, metadata)
        return cls(tensors, metadata, digests.layout_digest((t.name, t.dtype, t.shape, t.digest or "")
                                                             for t in tensors))

    def pack(self) -> bytes:
        wire: dict[str, Any] = {"tensors": [t.to_wire() for t in self.tensors], "metadata": self.metadata}
        if self.digest is not None:
            wire["digest"] = self.digest
        packed: bytes = msgpack.packb(wire, use_bin_type=True)
        return packed


def _counts(value: Any, name: str, field: str) -> tuple[int, ...]:
    """Tensor ``name``'s ``field``, a list of at most MAX_DIMS non-negative ints (not bools), as a tuple
    (checked in a plain loop: a layout may list 100,000 tensors)."""
    if not isinstance(value, list | tuple) or len(value) > MAX_DIMS:
        raise BadArgument(f"tensor {name!r}: {field} must be a list of at most {MAX_DIMS} integers")
    for v in value:
        if type(v) is not int or v < 0:
            raise BadArgument(f"tensor {name!r}: {field} must hold non-negative integers, got {value!r}")
    return tuple(value)


def check_manifest(raw: bytes, size: int) -> Manifest:
    """The manifest ``raw`` packs, checked against a buffer of ``size`` bytes; :class:`BadArgument`
    saying what is wrong (nothing is published then)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BadArgument(f"a manifest of {len(raw)} bytes is larger than {MAX_MANIFEST_BYTES}")
    try:
        decoded = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise BadArgument(f"the manifest is not msgpack: {exc}") from None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("tensors"), list):
        raise BadArgument("a manifest is a map with a 'tensors' list (and optionally a 'metadata' map)")
    metadata = decoded.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BadArgument("the manifest's 'metadata' must be a map")
    stated = decoded.get("digest")
    if stated is not None and not digests.is_digest(stated):
        raise BadArgument(f"the manifest's 'digest' must be {digests.ALGORITHM}: and 32 lowercase hex digits")
    entries = decoded["tensors"]
    if len(entries) > MAX_TENSORS:
        raise BadArgument(f"a manifest lists at most {MAX_TENSORS} tensors, this one {len(entries)}")
    specs, names = [], set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise BadArgument(f"tensor {index} of the manifest is not a map")
        name = entry.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise BadArgument(f"tensor {index}: 'name' must be a string of 1 to {MAX_NAME_CHARS} characters")
        if name in names:
            raise BadArgument(f"tensor name {name!r} appears twice in the manifest")
        names.add(name)
        dtype = entry.get("dtype")
        if dtype not in DTYPES:
            raise BadArgument(f"tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        shape = _counts(entry.get("shape"), name, "shape")
        strides = c_strides(shape) if entry.get("strides") is None else _counts(entry["strides"], name, "strides")
        if len(strides) != len(shape):
            raise BadArgument(f"tensor {name!r}: {len(shape)} dimensions but {len(strides)} strides")
        offset = entry.get("offset")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise BadArgument(f"tensor {name!r}: 'offset' must be a non-negative integer")
        if offset % DTYPES[dtype].itemsize:
            raise BadArgument(f"tensor {name!r}: offset {offset} is not a multiple of its item size")
        digest = entry.get("digest")
        if digest is not None and not digests.is_digest(digest):
            raise BadArgument(f"tensor {name!r}: 'digest' must be {digests.ALGORITHM}: and 32 lowercase hex digits")
        spec = TensorSpec(name, dtype, shape, strides, offset, digest)
        end = spec.extent()
        if end > size:
            raise BadArgument(f"tensor {name!r} ends at byte {end}, past the {size}-byte buffer")
        specs.append(spec)
    if stated is not None:
        computed = Manifest.digested(tuple(specs), metadata).digest
        if computed != stated:
            raise BadArgument(f"the manifest's digest {stated} is not its tensors' "
                              f"({computed or 'not every tensor has a digest'})")
    return Manifest(tuple(specs), metadata, stated)


def stated_digest(raw: bytes) -> str | None:
    """The layout digest a manifest checked once (:func:`check_manifest`) carries, a parked name's; None
    where it states none or does not decode."""
    try:
        decoded = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except ValueError:
        return None
    digest = decoded.get("digest") if isinstance(decoded, dict) else None
    return digest if digests.is_digest(digest) else None
