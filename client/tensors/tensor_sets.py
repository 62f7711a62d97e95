"""Tensors by name, the opening side: a published layout opened as zero-copy views.

:func:`open_tensors` looks the name up (and, given a digest, checks
it), opens the share once (one pool import, one pointer import) and returns a
:class:`TensorSet` of zero-copy :class:`SharedTensor` views: CUDA array
interface v3 on the cuda backend (torch, CuPy, numba), numpy's array interface
on the sim. :mod:`cuctxd.client.tensors.publishing` publishes them. Which thread may call: the client's callers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.api.sharing import OpenedShare, byte_interface
from cuctxd.client.tensors import dlpack
from cuctxd.client.tensors.copies import caller_device
from cuctxd.client.tensors.publishing import Source, checked_manifest
from cuctxd.protos.errors import BadArgument, DigestMismatch, WrongBackend
from cuctxd.protos.host import buffer_address
from cuctxd.protos.layouts import DTYPES, Manifest, TensorSpec
from cuctxd.protos.records import ShareDescriptor


class SharedTensor:
    """One tensor of an opened layout: a zero-copy view of the daemon's buffer."""

    def __init__(self, tensors: TensorSet, spec: TensorSpec) -> None:
        self._set = tensors
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def _interface(self, data: int, readonly: bool | None = None) -> dict[str, Any]:
        typestr = DTYPES[self.dtype].typestr
        if typestr is None:
            raise TypeError(f"{self.dtype} has no array-interface type: view the tensor through "
                            "cuctxd.client.tensors.tensor_sets.raw_interface and reinterpret its bytes")
        itemsize = DTYPES[self.dtype].itemsize
        return {"shape": self.shape, "typestr": typestr, "data": (data, self.readonly_flag(readonly)), "version": 3,
                "strides": tuple(s * itemsize for s in self.spec.strides)}

    def readonly_flag(self, asked: bool | None) -> bool:
        """The array interfaces' read-only flag: ``asked``, else the set's own (not ``writable``)."""
        return not self._set.writable if asked is None else asked

    def cuda_interface(self, *, readonly: bool | None = None) -> CudaArray:
        """The CUDA array interface with the read-only flag given (torch and CuPy take only False)."""
        return CudaArray(self._interface(self._set.share.ptr + self.spec.offset, readonly))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA array interface v3 (cuda backend): ``torch.as_tensor(t, device="cuda")``, ``cupy.asarray(t)``."""
        if self._set.share.backend != "cuda":
            raise WrongBackend(f"a {self._set.share.backend} layout lives in host memory; use numpy.asarray")
        return self._interface(self._set.share.ptr + self.spec.offset)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """numpy's array interface (sim backend): ``numpy.asarray(t)`` shares the daemon's bytes."""
        if self._set.share.backend != "sim":
            raise WrongBackend("a cuda layout lives in device memory; use __cuda_array_interface__")
        return self._interface(self._set.host_address + self.spec.offset)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, this process's ordinal of the GPU) on cuda; (kDLCPU, 0) on the sim."""
        if self._set.share.backend == "cuda":
            return dlpack.KDL_CUDA, self._set.cuda_ordinal()
        return dlpack.KDL_CPU, 0

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        """A DLPack capsule of the tensor (zero-copy; ``copy=True`` is refused). ``stream``: the
        consumer's stream; nothing needs ordering before it, since a layout's bytes were complete
        when it was published (and ``publish`` waited for them)."""
        if copy:
            raise BufferError("a shared tensor is exported without copying; copy it on the consumer's side")
        if self._set.share.backend == "cuda":
            data = self._set.share.ptr + self.spec.offset
        else:
            data = self._set.host_address + self.spec.offset
        return dlpack.capsule(data, self.__dlpack_device__(), DTYPES[self.dtype].dlpack, self.shape,
                              self.spec.strides, self._set)

    def __repr__(self) -> str:
        return f"SharedTensor({self.name!r}, {self.dtype}, shape={self.shape})"


class CudaArray:
    """An object that carries a CUDA array interface (what ``torch.as_tensor``/``cupy.asarray`` read); ``owner``:
    what keeps the memory it points at alive while this object lives."""

    def __init__(self, interface: dict[str, Any], owner: Any = None) -> None:
        self.__cuda_array_interface__ = interface
        self.owner = owner


class TensorSet(Mapping[str, SharedTensor]):
    """The tensors published under one name, mapped in this process until :meth:`close` (or ``with``);
    ``digest``: the layout's content digest (None where its publisher gave none); ``version``: the number of
    the name's version it is (0: not versioned), which stays mapped and valid while this set is open."""

    def __init__(self, share: OpenedShare, manifest: Manifest, writable: bool) -> None:
        self.share = share
        self.manifest = manifest
        self.writable = writable
        self.metadata = manifest.metadata
        self.digest = manifest.digest
        self.version = share.descriptor.version
        self.host_address = 0
        if share.backend == "sim":
            with buffer_address(share.host_view()) as address:
                self.host_address = address  # valid while the share stays mapped
        self._tensors = {spec.name: SharedTensor(self, spec) for spec in manifest.tensors}

    def __getitem__(self, name: str) -> SharedTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"the layout {self.share.descriptor.name!r} has no tensor {name!r} "
                           f"(it has {len(self._tensors)}: {', '.join(list(self._tensors)[:8])}...)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def backend(self) -> str:
        """The daemon's backend: ``"cuda"`` (tensors in device memory: ``torch.from_dlpack``,
        ``cupy.from_dlpack``) or ``"sim"`` (host memory: ``numpy.asarray``)."""
        return self.share.backend

    def cuda_ordinal(self) -> int:
        """This process's ordinal of the layout's GPU (DLPack names devices by it)."""
        from cuctxd.client.data_plane.ipc_cuda import ordinal_of

        return ordinal_of(self.share.descriptor.device_uuid)

    def refresh(self, *, digest: str | None = None) -> TensorSet | None:
        """The set of the name's newest version, opened as this one was, or None if there is none newer
        (:func:`open_tensors`); this set stays open: close it once nothing uses it any more."""
        client = self.share.client
        assert isinstance(client, Client)  # the client that opened the share, so the same flavour
        name = self.share.descriptor.name
        if name is None:
            return None
        descriptor = client.lookup(name)
        if descriptor.version <= self.version:
            return None
        return _open_layout(client, name, descriptor, self.writable, digest)

    def copy_into(self, destinations: Mapping[str, Any]) -> int:
        """Copy each tensor into the array of its name in ``destinations`` (same dtype size and byte count;
        numpy arrays on the sim, CUDA arrays on the layout's GPU: ``cuMemcpyDtoD`` here, nothing through the
        daemon); returns the bytes copied. For engines that keep parameters of their own."""
        missing = [key for key in self._tensors if key not in destinations]
        if missing:
            raise BadArgument(f"no destination for {len(missing)} tensors of the layout (first: {missing[0]!r})")
        pieces = [_copy_tensor(tensor, destinations[key]) for key, tensor in self._tensors.items()]
        device_pieces = [piece for piece in pieces if piece is not None]
        if device_pieces:
            from cuctxd.client.data_plane.ipc_cuda import copy_device_to_device

            copy_device_to_device(self.share.descriptor.device_uuid, device_pieces)
        return sum(tensor.nbytes for tensor in self._tensors.values())

    def close(self) -> None:
        """Unmap the layout and drop the hold; views made from it must not be used afterwards."""
        self.share.close()

    def __enter__(self) -> TensorSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tensors(client: Client, name: str, *, writable: bool = False, digest: str | None = None,
                 device: int | None = None) -> TensorSet:
    """Map the tensors published as ``name``: its copy on ``device``, by default on this process's own device
    (:func:`~cuctxd.client.tensors.copies.caller_device`, matched by UUID; a sim process that names none opens the
    first copy); :class:`~cuctxd.protos.errors.NoCopy`, listing where copies are, where that device has none.
    Read-only views unless ``writable``, which a layout published ``read_only`` refuses; both are advisory: a
    mapping of device memory cannot be made read-only. ``digest``: the content required (a layout digest,
    :mod:`cuctxd.protos.digests`); a layout with another one, or none, or whose bytes the daemon finds do not bear
    it out (``verify_shared``: a layout of another user's), raises :class:`~cuctxd.protos.errors.DigestMismatch`
    before anything is mapped."""
    return _open_layout(client, name, client.lookup(name, device=caller_device(client) if device is None else device),
                        writable, digest)


def _open_layout(client: Client, name: str, descriptor: ShareDescriptor, writable: bool, digest: str | None
                 ) -> TensorSet:
    """:func:`open_tensors` of the descriptor ``name``'s lookup gave."""
    if not descriptor.manifest:
        raise BadArgument(f"{name!r} was published as a plain buffer, without a tensor layout")
    if writable and descriptor.read_only:
        raise BadArgument(f"{name!r} was published read-only: open it with writable=False")
    manifest = checked_manifest(descriptor.manifest, descriptor.size)
    if digest is not None:
        # A version copied device to device has no digest until the daemon finds it; verify_shared waits for that.
        hashing = manifest.digest is None and bool(descriptor.version)
        if not hashing:
            _require(name, manifest, digest)
        client.verify_shared(name, digest, descriptor.device)  # another uid's word is checked by the daemon
        if hashing:  # the daemon's digest is found now: the version's manifest carries it
            descriptor = client.lookup(name, device=descriptor.device, version=descriptor.version)
            manifest = checked_manifest(descriptor.manifest or b"", descriptor.size)
            _require(name, manifest, digest)
    return TensorSet(client.open_shared(descriptor), manifest, writable)


def _require(name: str, manifest: Manifest, digest: str) -> None:
    """:class:`DigestMismatch` unless the layout's digest is ``digest``."""
    if manifest.digest != digest:
        raise DigestMismatch(f"{name!r} holds {manifest.digest or 'a layout without a digest'}, not the "
                             f"required {digest}")


def _copy_tensor(tensor: SharedTensor, destination: Any) -> tuple[int, int, int] | None:
    """One tensor's bytes into a host ``destination`` now, or the ``(dst, src, size)`` of its device copy
    (:meth:`TensorSet.copy_into` makes them all at once)."""
    source = Source(tensor.name, destination)
    if source.nbytes != tensor.nbytes or DTYPES[source.dtype].itemsize != DTYPES[tensor.dtype].itemsize:
        raise BadArgument(f"tensor {tensor.name!r}: {tensor.dtype}{list(tensor.shape)} cannot be copied into "
                          f"{source.dtype}{list(source.shape)}")
    share = tensor._set.share
    if source.device_ptr is not None:
        if share.backend != "cuda":
            raise WrongBackend(f"a {share.backend} layout is host memory: copy it into host arrays")
        return source.device_ptr, share.ptr + tensor.spec.offset, tensor.nbytes
    if source.host is None or share.backend != "sim":
        raise WrongBackend(f"a {share.backend} layout is copied into CUDA arrays on its GPU")
    if source.host.readonly:
        raise BadArgument(f"tensor {tensor.name!r}: the destination is read-only")
    source.host.cast("B")[:] = share.host_view()[tensor.spec.offset:tensor.spec.extent()]
    return None


def raw_interface(tensor: SharedTensor, *, readonly: bool | None = None) -> dict[str, Any]:
    """The tensor's bytes as a flat uint8 CUDA array interface (for dtypes the interface cannot name);
    ``readonly`` defaults to the set's own (torch accepts only False)."""
    return byte_interface(tensor._set.share.ptr + tensor.spec.offset, tensor.nbytes, tensor.readonly_flag(readonly))


__all__ = ["CudaArray", "SharedTensor", "TensorSet", "open_tensors", "raw_interface"]
