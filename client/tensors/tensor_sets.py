"""Tensors by name: many tensors in one shared buffer, published with their layout and opened as views.

:func:`publish_tensors` lays the tensors out in one daemon allocation (each at a
multiple of ``ALIGNMENT`` bytes, :func:`layout_offsets`), copies them in (device to
device when they are on the buffer's GPU in this process; through the data plane
from host memory, hashed meanwhile) and publishes the buffer with its manifest
(:mod:`cuctxd.protos.layouts`) through :func:`publish_layout`, which
``cuctx load`` shares. A failure frees the buffer: nothing is left half
published. :func:`open_tensors` looks the name up (and, given a digest, checks
it), opens the share once (one pool import, one pointer import) and returns a
:class:`TensorSet` of zero-copy :class:`SharedTensor` views: CUDA array
interface v3 on the cuda backend (torch, CuPy, numba), numpy's array interface
on the sim. Which thread may call: the client's callers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.api.sharing import OpenedShare, byte_interface
from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors import dlpack
from cuctxd.client.tensors.copies import Devices, caller_device, first_and_copies, stage_copies
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.wire import build
from cuctxd.protos.errors import BadArgument, CudaError, DigestMismatch, WrongBackend
from cuctxd.protos.host import buffer_address
from cuctxd.protos.layouts import ALIGNMENT, BY_TYPESTR, DTYPES, Manifest, TensorSpec, c_strides, check_manifest
from cuctxd.protos.records import ShareDescriptor
from cuctxd.protos.sizes import human_size


class RawBytes:
    """A tensor given as its bytes (a host buffer), its dtype name and its shape: what a file holds."""

    def __init__(self, data: memoryview, dtype: str, shape: tuple[int, ...]) -> None:
        self.data, self.dtype, self.shape = data, dtype, shape


class _Source:
    """Where one tensor's bytes come from: a device pointer in this process, or a host buffer."""

    def __init__(self, name: str, value: Any) -> None:
        """``value``: a CUDA array or host buffer, or ``(array, dtype name)`` to publish its bytes as another
        dtype of the same size (bfloat16, which the array interfaces cannot name)."""
        self.name = name
        self.dtype = ""
        self.shape: tuple[int, ...] = ()
        self.device_ptr: int | None = None
        self.host: memoryview | None = None
        dtype = None
        if isinstance(value, tuple):
            value, dtype = value
        self._read(value)
        if dtype is not None:
            if dtype not in DTYPES or DTYPES[dtype].itemsize != DTYPES[self.dtype].itemsize:
                raise BadArgument(f"tensor {name!r}: cannot publish {self.dtype} elements as {dtype!r}")
            self.dtype = dtype
        self.nbytes = DTYPES[self.dtype].itemsize * math.prod(self.shape)

    def _read(self, value: Any) -> None:
        if isinstance(value, RawBytes):
            if value.dtype not in DTYPES:
                raise BadArgument(f"tensor {self.name!r}: unknown dtype {value.dtype!r}")
            expected = DTYPES[value.dtype].itemsize * math.prod(value.shape)
            if value.data.nbytes != expected:
                raise BadArgument(f"tensor {self.name!r} of shape {value.shape} ({value.dtype}) needs {expected} "
                                  f"bytes, not {value.data.nbytes}")
            self.dtype, self.shape, self.host = value.dtype, value.shape, value.data.cast("B")
            return
        interface = getattr(value, "__cuda_array_interface__", None)
        if interface is not None:
            self.dtype = _dtype_of(self.name, interface["typestr"])
            self.shape = tuple(interface["shape"])
            self._require_contiguous(interface.get("strides"))
            self.device_ptr = int(interface["data"][0])
        else:
            view = _host_view(self.name, value)
            self.host = view
            self.dtype = _dtype_of(self.name, view.format)
            self.shape = tuple(view.shape or ())

    def _require_contiguous(self, strides: Any) -> None:
        if strides is not None and tuple(strides) != tuple(s * DTYPES[self.dtype].itemsize
                                                           for s in c_strides(self.shape)):
            raise BadArgument(f"tensor {self.name!r} is not C-contiguous: make it contiguous first")


def _host_view(name: str, value: Any) -> memoryview:
    try:
        view = memoryview(value)
    except TypeError:
        try:
            import numpy
        except ImportError:
            raise BadArgument(f"tensor {name!r}: {type(value).__name__} is neither a CUDA array nor a "
                              "host buffer") from None
        view = numpy.ascontiguousarray(value).data
    if not view.c_contiguous:
        raise BadArgument(f"tensor {name!r} is not C-contiguous: make it contiguous first")
    return view


_FORMATS = {"b": "|i1", "B": "|u1", "h": "<i2", "H": "<u2", "i": "<i4", "I": "<u4", "l": "<i8", "L": "<u8",
            "q": "<i8", "Q": "<u8", "e": "<f2", "f": "<f4", "d": "<f8", "?": "|b1", "Zf": "<c8", "Zd": "<c16"}


def _dtype_of(name: str, typestr: str) -> str:
    key = typestr if typestr in BY_TYPESTR else _FORMATS.get(typestr.lstrip("|<=@"))
    if key is None or key not in BY_TYPESTR:
        raise BadArgument(f"tensor {name!r}: element type {typestr!r} has no dtype in a layout "
                          f"(known: {', '.join(DTYPES)})")
    return BY_TYPESTR[key]


def layout_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Each tensor's offset, in order, each at a multiple of ALIGNMENT (an empty tensor takes ALIGNMENT
    bytes too), and the buffer's size: the one rule of every layout this client makes."""
    offsets, at = [], 0
    for nbytes in sizes:
        offsets.append(at)
        at += -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
    return offsets, max(at, ALIGNMENT)


#: A layout's tensors as a plan is made of them: (name, dtype, shape) each, in order.
Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def plan_layout(tensors: Mapping[str, Any], metadata: Mapping[str, Any] | None = None
                ) -> tuple[Manifest, list[_Source], int]:
    """Where each tensor goes (C order, :func:`layout_offsets`): the manifest, the sources, the size. Without
    metadata the manifest of the same tensors is made once (:func:`_planned`): a trainer plans every version."""
    sources = [_Source(str(name), value) for name, value in tensors.items()]
    manifest, size, _ = _planned(tuple((source.name, source.dtype, source.shape) for source in sources))
    if metadata:
        manifest = Manifest(manifest.tensors, dict(metadata))
    return manifest, sources, size


@functools.lru_cache(maxsize=4)
def _planned(signature: Signature) -> tuple[Manifest, int, bytes]:
    """The manifest (without metadata) of tensors of ``signature`` laid out in order, the size, and the manifest
    packed."""
    offsets, size = layout_offsets(DTYPES[dtype].itemsize * math.prod(shape) for _, dtype, shape in signature)
    specs = tuple(TensorSpec(name, dtype, shape, c_strides(shape), offset)
                  for (name, dtype, shape), offset in zip(signature, offsets, strict=True))
    manifest = Manifest(specs, {})
    return manifest, size, manifest.pack()


def packed_manifest(manifest: Manifest) -> bytes:
    """``manifest`` packed: its plan's packing where it is a plan's manifest without metadata."""
    if not manifest.metadata and manifest.digest is None:
        planned, _, packed = _planned(tuple((spec.name, spec.dtype, spec.shape) for spec in manifest.tensors))
        if manifest is planned or manifest == planned:
            return packed
    return manifest.pack()


def publish_layout(client: Client, name: str, manifest: Manifest, size: int,
                   fill: Callable[[Any, str], Sequence[str | None]], *, device: Devices = None,
                   persistent: bool = True, read_only: bool = False, replace: bool = False,
                   version: bool = False) -> ShareDescriptor:
    """Allocate one shareable buffer of ``size`` bytes on ``device`` (several: the first; the others get copies
    of it; a ``version``: :func:`alloc_version`), ``fill(buffer, buffer_id)`` it (``buffer_id``: a version's
    allocation, else ""; it returns each tensor's digest in the manifest's order, None where unknown), and
    publish it (:func:`publish_filled`).
    The manifest is checked first, as the daemon will. Nothing stays published or allocated when this
    raises; a device without room raises the allocation's ``CUDA_ERROR_OUT_OF_MEMORY`` with the sizes in
    its message (:func:`no_room`)."""
    packed = packed_manifest(manifest)
    checked_manifest(packed, size)  # what the daemon will check, said before any memory is taken
    device, copies = first_and_copies(client, device)
    buffer_id = ""
    try:
        if version:
            buffer, buffer_id = alloc_version(client, name, size, device)
        else:
            buffer = client.alloc(size, device, shareable=True)
    except CudaError as error:
        raise no_room(client, error, size, device, len(manifest.tensors)) from None
    try:
        found = fill(buffer, buffer_id)
    except BaseException:
        buffer.free()
        raise
    return publish_filled(client, name, manifest, buffer, found, persistent=persistent, read_only=read_only,
                          replace=replace, copies=copies, version=version, packed=packed)


def alloc_version(client: Client, name: str, size: int, device: int | None) -> tuple[Any, str]:
    """A buffer for ``name``'s next version (its spare where the daemon has one that fits) and its allocation's
    buffer id; this client's mappings of the name's buffers are kept from now on (:mod:`vmm_imports`)."""
    from cuctxd.client.api.objects import Buffer

    buffer, buffer_id, buffers = client.run(build.alloc_version(client, Buffer, size, device, name))
    VMM_IMPORTS.publishing(client, name, (*buffers, buffer_id))
    return buffer, buffer_id


@functools.lru_cache(maxsize=4)
def checked_manifest(packed: bytes, size: int) -> Manifest:
    """:func:`check_manifest`, once per manifest and size in this process: a trainer publishes the same layout
    every version, an engine opens it every version (a manifest of 300 tensors takes about 1.5 ms to check)."""
    return check_manifest(packed, size)


def publish_filled(client: Client, name: str, manifest: Manifest, buffer: Any, found: Sequence[str | None], *,
                   persistent: bool = True, read_only: bool = False, replace: bool = False,
                   copies: Sequence[int] = (), version: bool = False, packed: bytes | None = None
                   ) -> ShareDescriptor:
    """Publish ``buffer`` as ``name`` with the manifest and each tensor's digest ``found`` (the layout's
    digest where every tensor has one); ``replace``: swap a name in use (``publish``'s ``replace``);
    ``copies``: devices that get a copy of it, filled on the GPU and staged first, so that the publish brings
    every copy in at once (:mod:`cuctxd.client.tensors.copies`); ``version``: as the name's next version, the
    buffer handed to the daemon (on one device: a version has no copies). ``packed``: the manifest packed, where
    the caller has it. Returns the share's descriptor with that manifest; frees the buffer and the copies when this
    raises."""
    staged: list[Any] = []
    try:
        if version and copies:
            raise BadArgument(f"a version of {name!r} is published on one device: it has no copies")
        packed = digested(manifest, found, packed)
        staged = stage_copies(client, name, buffer, copies, packed, persistent=persistent, read_only=read_only)
        published: ShareDescriptor = client.run(build.publish(buffer, name, packed, persistent, read_only,
                                                              replace=replace, version=version))
        if version:
            VMM_IMPORTS.told(name, published.buffers)
        return dataclasses.replace(published, manifest=packed)
    except BaseException:
        for copy in staged:
            copy.free()
        buffer.free()
        raise


def digested(manifest: Manifest, found: Sequence[str | None], packed: bytes | None = None) -> bytes:
    """The manifest packed with each tensor's digest ``found`` (and the layout's, where every tensor has one);
    ``packed`` (the manifest's own packing) as it is where neither it nor ``found`` has any digest."""
    if packed is not None and not any(found) and not any(spec.digest for spec in manifest.tensors):
        return packed
    specs = tuple(dataclasses.replace(spec, digest=digest)
                  for spec, digest in zip(manifest.tensors, found, strict=True))
    return Manifest.digested(specs, manifest.metadata).pack()


def device_copies(manifest: Manifest, sources: Sequence[_Source], base: int) -> list[tuple[int, int, int]]:
    """The ``(dst, src, size)`` copy of each tensor that is on the device into a buffer mapped at ``base``."""
    return [(base + spec.offset, source.device_ptr, source.nbytes)
            for spec, source in zip(manifest.tensors, sources, strict=True) if source.device_ptr is not None]


def no_room(client: Client, error: CudaError, size: int, device: int | None, tensors: int) -> CudaError:
    """``error`` as it is, or, for ``CUDA_ERROR_OUT_OF_MEMORY``, with what the layout needs and the device has."""
    if error.name != "CUDA_ERROR_OUT_OF_MEMORY":
        return error
    free, total = client.mem_get_info(device)
    return CudaError(error.code, error.name, f"the layout of {tensors} tensors needs {_size_text(size)} in one "
                     f"buffer; this session may allocate {_size_text(free)} of the device's "
                     f"{_size_text(total)} ({error.message})")


def _size_text(nbytes: int) -> str:
    return f"{human_size(nbytes)} ({nbytes} bytes)"


def publish_tensors(client: Client, name: str, tensors: Mapping[str, Any], metadata: Mapping[str, Any] | None = None,
                    *, device: Devices = None, progress: Callable[[int, int], None] | None = None,
                    persistent: bool = True, read_only: bool = False, replace: bool = False,
                    digest: bool = True, version: bool = False) -> ShareDescriptor:
    """Put ``tensors`` (name -> CUDA array, host buffer or :class:`RawBytes`) in one buffer on ``device``
    and publish it as ``name`` with their manifest; returns the share's descriptor (of the first copy, where
    ``device`` lists several devices: each gets a copy, filled from the first on the GPU). ``progress(done,
    total)``: bytes copied so far. ``persistent`` (the default): the layout stays until unpublished, so
    workers can come and go (``False``: freed once its last consumer closes it, as a plain publish).
    ``read_only``: consumers may open it only read-only; ``replace``: swap a name in use; ``version``: publish
    it as the name's next version (:func:`cuctxd.client.tensors.versions.publish_version`). ``digest``: host
    tensors are hashed while they are copied (the layout has a digest when no tensor came from a device).
    Nothing stays published or allocated when this raises."""
    manifest, sources, size = plan_layout(tensors, metadata)

    def fill(buffer: Any, buffer_id: str) -> list[str | None]:
        hashed = {index: source.host for index, source in enumerate(sources) if source.host is not None}
        if not hashed:  # device tensors only (a trainer's): no hashing thread to start
            if sources:
                _copy_from_device(client, buffer, manifest, sources, buffer_id)
            return [None] * len(sources)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuctxd-digests") as pool:  # waits for it
            running = pool.submit(hash_views, list(hashed.values())) if digest and hashed else None
            host_sources = [(manifest.tensors[index].offset, view) for index, view in hashed.items() if view.nbytes]
            _write_host_sources(client, buffer, host_sources, sum(source.nbytes for source in sources), progress)
            if any(source.device_ptr is not None for source in sources):
                _copy_from_device(client, buffer, manifest, sources, buffer_id)
            found = dict(zip(hashed, running.result(), strict=True)) if running is not None else {}
        return [found.get(index) for index in range(len(sources))]

    return publish_layout(client, name, manifest, size, fill, device=device, persistent=persistent,
                          read_only=read_only, replace=replace, version=version)


#: Bytes written between two progress reports of :func:`publish_tensors`.
PROGRESS_BYTES = 256 << 20


def _write_host_sources(client: Client, buffer: Any, pieces: list[tuple[int, memoryview]], total: int,
                        progress: Callable[[int, int], None] | None) -> None:
    """The host tensors into the buffer through the staging ring, many per DMA
    (:func:`~cuctxd.client.data_plane.transfers.write_pieces`), in batches of :data:`PROGRESS_BYTES` between
    progress reports."""
    done, batch, batch_bytes = 0, [], 0
    for index, (offset, view) in enumerate(pieces):
        batch.append((offset, view))
        batch_bytes += view.nbytes
        if batch_bytes >= PROGRESS_BYTES or index == len(pieces) - 1:
            done += client.run(transfers.write_pieces(client, buffer, batch))
            batch, batch_bytes = [], 0
            if progress is not None:
                progress(done, total)


def _copy_from_device(client: Client, buffer: Any, manifest: Manifest, sources: list[_Source],
                      buffer_id: str) -> None:
    """Device-to-device copies into the daemon's buffer, mapped here: through this process's mapping of its
    allocation where it has one (a version's buffer reused: no request, no fd), else exported and opened."""
    if client.backend != "cuda":
        raise BadArgument(f"CUDA arrays cannot be copied into a {client.backend} daemon's buffer")
    from cuctxd.client.data_plane.ipc_cuda import copy_device_to_device

    leased = VMM_IMPORTS.lease(buffer_id) if buffer_id else None
    if leased is not None:
        opening, device_uuid = leased
        try:
            copy_device_to_device(device_uuid, device_copies(manifest, sources, opening.ptr))
        finally:
            opening.close()
        return
    with client.open_shared(client.export(buffer)) as mapped:
        copy_device_to_device(mapped.descriptor.device_uuid, device_copies(manifest, sources, mapped.ptr))


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
        if manifest.digest is None and descriptor.version:  # copied device to device: the daemon is hashing it
            client.verify_shared(name, digest, descriptor.device)
            descriptor = client.lookup(name, device=descriptor.device, version=descriptor.version)
            manifest = checked_manifest(descriptor.manifest or b"", descriptor.size)
        if manifest.digest != digest:
            raise DigestMismatch(f"{name!r} holds {manifest.digest or 'a layout without a digest'}, not the "
                                 f"required {digest}")
        client.verify_shared(name, digest, descriptor.device)  # another uid's word is checked by the daemon
    return TensorSet(client.open_shared(descriptor), manifest, writable)


def _copy_tensor(tensor: SharedTensor, destination: Any) -> tuple[int, int, int] | None:
    """One tensor's bytes into a host ``destination`` now, or the ``(dst, src, size)`` of its device copy
    (:meth:`TensorSet.copy_into` makes them all at once)."""
    source = _Source(tensor.name, destination)
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


__all__ = ["CudaArray", "RawBytes", "SharedTensor", "TensorSet", "layout_offsets", "open_tensors", "plan_layout",
           "publish_layout", "publish_tensors", "raw_interface"]
