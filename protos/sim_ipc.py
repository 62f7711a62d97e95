"""The sim backend's 64-byte IPC handle: the path of the allocation's shared-memory file.

It travels inside share descriptors, so both the daemon's sim backend (which
creates the file) and the client (which maps it) use these two functions.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HANDLE_SIZE = 64
_MAGIC = b"cuctxd-sim:"


def shm_dir() -> Path:
    """``/dev/shm`` where the kernel offers it, else the temp directory."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def encode_handle(path: Path) -> bytes:
    raw = _MAGIC + os.fsencode(path)
    if len(raw) > HANDLE_SIZE:
        raise ValueError(f"shared-memory path {path} is too long for a {HANDLE_SIZE}-byte handle")
    return raw.ljust(HANDLE_SIZE, b"\0")


def decode_handle(handle: bytes) -> Path:
    """The file a sim handle names; ValueError if it is not a sim handle."""
    if len(handle) != HANDLE_SIZE or not handle.startswith(_MAGIC):
        raise ValueError("not a cuctxd sim IPC handle")
    return Path(os.fsdecode(handle[len(_MAGIC):].rstrip(b"\0")))
