"""Host facts both sides use: which host a process runs on (so a share descriptor can tell it is
being opened elsewhere), and the raw address of a host buffer (for copies that release the GIL)."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path


@cache
def host_identity() -> str:
    """``boot:<boot id>``: equal for two processes only on the same running machine, containers included.

    The kernel's boot id is one random value per boot, the same in every container (a Kubernetes pod
    next to the daemon's has its own host name, but not its own kernel): the host name is not part
    of it (NCCL tells hosts apart the same way). Where the boot id cannot be read, ``<hostname>/unknown-boot``.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"boot:{boot}" if boot else f"{socket.gethostname()}/unknown-boot"


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI): how the raw address of any buffer is read."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None
_PYBUF_SIMPLE = 0


@contextmanager
def buffer_address(buffer: object) -> Iterator[int]:
    """The address of a contiguous buffer (read-only ones too), pinned by a buffer export meanwhile."""
    export = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(export), _PYBUF_SIMPLE)
    try:
        yield export.buf or 0
    finally:
        _release_buffer(ctypes.byref(export))
