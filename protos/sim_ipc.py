"""The sim backend's 64-byte IPC data: a legacy handle (a path to open) and a pool pointer (an offset).

They travel inside share descriptors, so both the daemon's sim backend (which
makes them) and the client (which maps them) use these functions. A legacy
handle names ``/proc/<daemon pid>/fd/<n>``, a memfd of the daemon; a pool pointer
names a block of the pool's memfd, which the client imported through the fd channel.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

HANDLE_SIZE = 64
_MAGIC = b"cuctxd-sim:"
_POOL_MAGIC = b"cuctxd-sim-pool:"
_POOL_FIELDS = struct.Struct("<QQ")


def encode_handle(path: str | Path) -> bytes:
    raw = _MAGIC + os.fsencode(path)
    if len(raw) > HANDLE_SIZE:
        raise ValueError(f"path {path} is too long for a {HANDLE_SIZE}-byte handle")
    return raw.ljust(HANDLE_SIZE, b"\0")


def decode_handle(handle: bytes) -> Path:
    """The path a sim handle names; ValueError if it is not a sim handle."""
    if len(handle) != HANDLE_SIZE or not handle.startswith(_MAGIC):
        raise ValueError("not a cuctxd sim IPC handle")
    return Path(os.fsdecode(handle[len(_MAGIC):].rstrip(b"\0")))


def encode_pool_pointer(offset: int, size: int) -> bytes:
    """A block of a sim pool's shared memory: the magic, then offset and size, 8 bytes each, little-endian."""
    return (_POOL_MAGIC + _POOL_FIELDS.pack(offset, size)).ljust(HANDLE_SIZE, b"\0")


def decode_pool_pointer(data: bytes) -> tuple[int, int]:
    """(offset, size) of a sim pool pointer; ValueError if ``data`` is not one."""
    if len(data) != HANDLE_SIZE or not data.startswith(_POOL_MAGIC):
        raise ValueError("not a cuctxd sim pool pointer")
    offset, size = _POOL_FIELDS.unpack_from(data, len(_POOL_MAGIC))
    return offset, size
