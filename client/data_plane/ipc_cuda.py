"""Mapping a cuda-backend share in this process: a pool import and ``cuMemPoolImportPointer``, a VMM
allocation imported from its fd and mapped (``cuMemImportFromShareableHandle``, ``cuMemMap``), or a
legacy ``cuIpcOpenMemHandle``.

The mapping lives in this process's primary context of the same GPU (found by
UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering does not matter), which is the
context CuPy and PyTorch use too: the pointer works directly with them. The
driver calls go through :mod:`cuctxd.client.data_plane.cuda_driver` (ctypes on libcuda).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cuctxd.client.data_plane.cuda_driver import Driver, driver
from cuctxd.protos.errors import CudaError
from cuctxd.protos.host import buffer_address
from cuctxd.protos.records import ShareDescriptor

log = logging.getLogger(__name__)
#: Bytes staged through host memory at a time where two GPUs refuse a peer copy.
_STAGE_BYTES = 64 << 20


class _Primary:
    """A reference on this process's primary context of one GPU, held until :meth:`release`."""

    def __init__(self, cu: Driver, device_uuid: str) -> None:
        self.cu = cu
        self.device = cu.find_device(device_uuid)
        self.context = cu.retain_primary(self.device)

    def release(self) -> None:
        self.cu.release_primary(self.device)


class CudaMapping:
    """A device pointer to the shared allocation, valid in this process until :meth:`close`."""

    def __init__(self, descriptor: ShareDescriptor) -> None:
        self._primary = primary = _Primary(driver("map a cuda share"), descriptor.device_uuid)
        try:
            with primary.cu.current(primary.context):
                self.ptr = primary.cu.ipc_open(descriptor.ipc_handle)
        except BaseException:
            primary.release()
            raise

    def close(self) -> None:
        primary = self._primary
        try:
            with primary.cu.current(primary.context):
                primary.cu.ipc_close(self.ptr)
        finally:
            primary.release()


class CudaVmmMapping:
    """A ``"vmm"`` share mapped in this process from its fd (the caller still closes it): imported, mapped whole at
    an address of its own and made read-write for the GPU; ``ptr`` until :meth:`close` unmaps it and releases the
    import (the memory itself lives on while the daemon, or its fd store, keeps it)."""

    def __init__(self, descriptor: ShareDescriptor, fd: int) -> None:
        self._primary = primary = _Primary(driver("map a cuda share"), descriptor.device_uuid)
        self._size = descriptor.allocation_size
        try:
            with primary.cu.current(primary.context):
                self.ptr, self._handle = primary.cu.vmm_import(fd, self._size, primary.device)
        except BaseException:
            primary.release()
            raise

    def close(self) -> None:
        primary = self._primary
        try:
            with primary.cu.current(primary.context):
                primary.cu.vmm_unmap(self.ptr, self._size, self._handle)
        finally:
            primary.release()


class CudaPoolImport:
    """A daemon pool imported into this process (``cuMemPoolImportFromShareableHandle``) from the fd the
    fd channel delivered (the caller still closes it); its buffers are imported one by one with
    :meth:`import_pointer`, in this process's primary context of the same GPU."""

    def __init__(self, fd: int, device_uuid: str) -> None:
        self._primary = primary = _Primary(driver("map a cuda share"), device_uuid)
        try:
            with primary.cu.current(primary.context):
                self._pool = primary.cu.pool_import(fd)
        except BaseException:
            primary.release()
            raise

    def import_pointer(self, export_data: bytes, size: int) -> CudaPoolMapping:
        """One buffer of the pool (``cuMemPoolImportPointer``, about 2 us)."""
        primary = self._primary
        with primary.cu.current(primary.context):
            ptr = primary.cu.pool_import_pointer(self._pool, export_data)
        return CudaPoolMapping(primary, ptr)

    def close(self) -> None:
        """``cuMemPoolDestroy`` of the import, once its buffers are closed; then the primary's reference."""
        primary = self._primary
        try:
            with primary.cu.current(primary.context):
                primary.cu.pool_destroy(self._pool)
        finally:
            primary.release()


class CudaPoolMapping:
    """A buffer imported from a pool: ``ptr`` until :meth:`close` frees the import (before the owner frees)."""

    def __init__(self, primary: _Primary, ptr: int) -> None:
        self._primary = primary
        self.ptr = ptr

    def close(self) -> None:
        with self._primary.cu.current(self._primary.context):
            self._primary.cu.free(self.ptr)


def copy_device_to_device(device_uuid: str, pieces: Sequence[tuple[int, int, int]]) -> None:
    """A device-to-device copy of each ``(dst, src, size)`` in this process's primary context of that GPU, all finished
    before it returns (one context made current, one synchronize: a layout's tensors copied into a daemon
    buffer mapped here, or out of it)."""
    primary = _Primary(driver("copy device memory"), device_uuid)
    try:
        with primary.cu.current(primary.context):
            primary.cu.copy_device_to_device(pieces)
    finally:
        primary.release()


def copy_with_host(device_uuid: str, device_ptr: int, host: int, size: int, *, to_host: bool) -> None:
    """A synchronous copy between a mapped share and host memory (``cuMemcpyDtoH``/``cuMemcpyHtoD``) in this
    process's primary context of that GPU: :meth:`~cuctxd.client.api.sharing.MappedShare.read_into` and
    ``write`` of a cuda share."""
    primary = _Primary(driver("copy device memory"), device_uuid)
    try:
        with primary.cu.current(primary.context):
            if to_host:
                primary.cu.copy_to_host(host, device_ptr, size)
            else:
                primary.cu.copy_from_host(device_ptr, host, size)
    finally:
        primary.release()


def copy_between_devices(dst_uuid: str, dst: int, src_uuid: str, src: int, size: int) -> None:
    """``cuMemcpyPeer`` from a share mapped on one GPU to one mapped on another, in this process's primary contexts
    of both, finished before it returns (a layout's copy filled from its copy on another device)."""
    cu = driver("copy between GPUs")
    dst_primary = _Primary(cu, dst_uuid)
    try:
        src_primary = _Primary(cu, src_uuid)
        try:
            try:
                with cu.current(dst_primary.context):
                    cu.copy_peer(dst, dst_primary.context, src, src_primary.context, size)
            except CudaError as error:
                log.info("cuMemcpyPeer from %s to %s refused (%s): the copy is staged through host memory",
                         src_uuid, dst_uuid, error.name)
                _copy_through_host(cu, dst_primary.context, dst, src_primary.context, src, size)
        finally:
            src_primary.release()
    finally:
        dst_primary.release()


def _copy_through_host(cu: Driver, dst_context: int, dst: int, src_context: int, src: int, size: int) -> None:
    """``size`` bytes from one GPU to another through a host buffer, :data:`_STAGE_BYTES` at a time."""
    staged = bytearray(min(size, _STAGE_BYTES))
    with buffer_address(memoryview(staged)) as host:
        for start in range(0, size, _STAGE_BYTES):
            count = min(_STAGE_BYTES, size - start)
            with cu.current(src_context):
                cu.copy_to_host(host, src + start, count)
            with cu.current(dst_context):
                cu.copy_from_host(dst + start, host, count)


def current_device_uuid() -> str:
    """The UUID of the GPU this thread's current context is on (ordinal 0's without one): the caller's GPU."""
    cu = driver("find this process's GPU")
    return cu.device_uuid(cu.current_device())


def device_uuid(ordinal: int) -> str:
    """The UUID of this process's GPU ``ordinal`` (torch's and CuPy's numbering, which is the driver's)."""
    return driver("find a GPU").device_uuid(ordinal)


def ordinal_of(device_uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with that UUID."""
    return driver("find a GPU").find_device(device_uuid)
