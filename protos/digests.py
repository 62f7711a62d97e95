"""Content digests: what a tensor's and a layout's bytes are, so a name is never taken for other weights.

A tensor's digest is ``xxh3-128:`` and 32 hex digits: XXH3-128 over the concatenated canonical (16-byte,
big-endian) XXH3-128 digests of its bytes cut into :data:`LEAF_BYTES` pieces from its first byte (a tensor
of no bytes has no pieces). Cutting in pieces lets the copy threads hash a large tensor at once, each its
own pieces, while the bytes pass. A layout's digest is the same hash over the sorted tensors' names, dtypes,
shapes and digests (:func:`layout_digest`), so two layouts share one exactly when every tensor does.
XXH3 is not a cryptographic hash: it tells contents apart by accident-proof identity (2^-64 for any two),
while who may (re)place a name is the daemon's ownership rule (PROTOCOL.md, "Digests"). Any thread may call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import xxhash

#: The algorithm's name, the prefix of every digest.
ALGORITHM = "xxh3-128"
#: Bytes of one piece (leaf) of a tensor's digest.
LEAF_BYTES = 2 << 20
#: Hex digits a short digest shows (``cuctx shared``).
SHORT_DIGITS = 12


def leaf(data: memoryview | bytes) -> bytes:
    """The canonical digest of one piece (at most :data:`LEAF_BYTES`); releases the GIL while hashing."""
    return xxhash.xxh3_128_digest(data)


def from_leaves(leaves: Iterable[bytes]) -> str:
    """A tensor's digest from its pieces' digests, in order."""
    combined = xxhash.xxh3_128()
    for piece in leaves:
        combined.update(piece)
    return f"{ALGORITHM}:{combined.hexdigest()}"


def tensor_digest(data: memoryview | bytes) -> str:
    """The digest of one tensor's bytes, hashed here in one go."""
    view = memoryview(data).cast("B")
    return from_leaves(leaf(view[at:at + LEAF_BYTES]) for at in range(0, view.nbytes, LEAF_BYTES))


def layout_digest(tensors: Iterable[tuple[str, str, Sequence[int], str]]) -> str:
    """A layout's digest from its tensors' ``(name, dtype, shape, digest)``, in any order."""
    canonical = json.dumps(sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in tensors),
                           separators=(",", ":"), ensure_ascii=False)
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(canonical.encode())}"


def is_digest(value: object) -> bool:
    """Whether ``value`` is a digest as this module writes it."""
    if not isinstance(value, str) or not value.startswith(ALGORITHM + ":"):
        return False
    digits = value[len(ALGORITHM) + 1:]
    return len(digits) == 32 and all(c in "0123456789abcdef" for c in digits)


def short(digest: str) -> str:
    """The first :data:`SHORT_DIGITS` hex digits, as ``cuctx shared`` shows them."""
    return digest.partition(":")[2][:SHORT_DIGITS]
