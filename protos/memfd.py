"""Shared memory the daemon hands out: memfds sealed against resizing (PROTOCOL.md, "Sealed shared memory").

The daemon itself maps every memfd whose fd a client gets (an shm lane's region, a
host buffer, the sim's pool and legacy IPC memory). A client that could shrink one
would turn the daemon's next touch of the pages cut off into a SIGBUS, and grow one
to charge the daemon's memory. So each is made with ``MFD_ALLOW_SEALING`` and, once
sized, sealed with :data:`RESIZE_SEALS` before any fd of it leaves the daemon: a
client's ``ftruncate`` (or growing ``fallocate``) then fails with ``EPERM``, while
mapping, reading and writing work as before. Linux only, as memfds are.
"""

from __future__ import annotations

import fcntl
import os

#: The seals on every memfd the daemon hands out: no shrinking, no growing, no further seals (nor removal).
RESIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes (close-on-exec) sealed with :data:`RESIZE_SEALS`; the caller owns the fd.
    Raises OSError if it cannot be made (nothing is left open then)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RESIZE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def resize_sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd that can no longer be shrunk nor grown (False for other kinds of file)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    return seals & need == need
