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


#: Environment variable naming the directory the sim backend exports into (default: see :func:`shm_dir`).
SHM_DIR_ENV = "CUCTXD_SIM_SHM_DIR"


def shm_dir() -> Path:
    """``$CUCTXD_SIM_SHM_DIR``, else ``/dev/shm`` where the kernel offers it, else the temp directory.

    Only the daemon reads it: a client maps the file a handle names, wherever it is.
    """
    chosen = os.environ.get(SHM_DIR_ENV)
    if chosen:
        return Path(chosen)
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
