"""DLPack export of shared tensors: the capsule ``__dlpack__`` returns (``torch.from_dlpack``,
``cupy.from_dlpack``, ``numpy.from_dlpack``, ``jax.dlpack``).

A legacy (unversioned) ``DLManagedTensor`` in a ``"dltensor"`` capsule, which every
consumer accepts: the standard lets a producer answer that even to a consumer
that asks for a versioned one. The memory stays owned by the opened layout (the
capsule keeps the layout's Python object alive until the consumer's deleter runs,
or until the capsule dies unconsumed). Any thread may call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

#: DLPack device types.
KDL_CPU = 1
KDL_CUDA = 2


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64))


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = (("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER))

_CAPSULE_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
# Called from the capsule's destructor, where the capsule is being freed: passed as a bare pointer (a
# py_object there would take a reference to an object already at zero).
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

#: What each exported tensor keeps alive (its structs, shape, strides, owner), by the managed struct's address.
_alive: dict[int, tuple[Any, ...]] = {}
_lock = threading.Lock()


def _delete(managed: Any) -> None:
    with _lock:
        _alive.pop(ctypes.addressof(managed.contents), None)


_deleter = _DELETER(_delete)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    """A capsule nobody consumed (still named ``dltensor``): run the deleter ourselves."""
    if _capsule_is_valid(capsule, _CAPSULE_NAME):
        address = _capsule_pointer(capsule, _CAPSULE_NAME)
        with _lock:
            _alive.pop(address, None)


def capsule(data: int, device: tuple[int, int], dtype: tuple[int, int], shape: tuple[int, ...],
            strides: tuple[int, ...], owner: object) -> Any:
    """A ``"dltensor"`` capsule over ``data`` (strides in elements); ``owner`` lives as long as the tensor."""
    ndim = len(shape)
    shape_array = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_array = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = _Managed()
    tensor = managed.dl_tensor
    tensor.data = data
    tensor.device = _Device(*device)
    tensor.ndim = ndim
    tensor.dtype = _DataType(dtype[0], dtype[1], 1)
    tensor.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides_array, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _lock:
        _alive[address] = (managed, shape_array, strides_array, owner)
    return _capsule_new(address, _CAPSULE_NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
