"""Tensors by name, the publishing side: many tensors laid out in one shared buffer and published with their layout.

:func:`publish_tensors` lays the tensors out in one daemon allocation (each at a
multiple of ``ALIGNMENT`` bytes, :func:`layout_offsets`), copies them in (device to
device when they are on the buffer's GPU in this process; through the data plane
from host memory, hashed meanwhile) and publishes the buffer with its manifest
(:mod:`cuctxd.protos.layouts`) through :func:`publish_layout`, which
``cuctx load`` shares. A failure frees the buffer: nothing is left half
published. :mod:`cuctxd.client.tensors.tensor_sets` opens what this publishes. Which thread may call: the
client's callers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors.copies import Devices, first_and_copies, stage_copies
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.wire import build
from cuctxd.protos.errors import BadArgument, CudaError
from cuctxd.protos.layouts import ALIGNMENT, BY_TYPESTR, DTYPES, Manifest, TensorSpec, c_strides, check_manifest
from cuctxd.protos.records import ShareDescriptor
from cuctxd.protos.sizes import human_size


class RawBytes:
    """A tensor given as its bytes (a host buffer), its dtype name and its shape: what a file holds."""

    def __init__(self, data: memoryview, dtype: str, shape: tuple[int, ...]) -> None:
        self.data, self.dtype, self.shape = data, dtype, shape


class Source:
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
                ) -> tuple[Manifest, list[Source], int]:
    """Where each tensor goes (C order, :func:`layout_offsets`): the manifest, the sources, the size. Without
    metadata the manifest of the same tensors is made once (:func:`_planned`): a trainer plans every version."""
    sources = [Source(str(name), value) for name, value in tensors.items()]
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


def device_copies(manifest: Manifest, sources: Sequence[Source], base: int) -> list[tuple[int, int, int]]:
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


def _copy_from_device(client: Client, buffer: Any, manifest: Manifest, sources: list[Source],
                      buffer_id: str) -> None:
    """Device-to-device copies into the daemon's buffer, mapped here: through this process's mapping of its
    allocation where it has one (a version's buffer reused: no request, no fd), else exported and opened."""
    if client.backend != "cuda":
        raise BadArgument(f"CUDA arrays cannot be copied into a {client.backend} daemon's buffer")
    from cuctxd.client.data_plane.ipc_cuda import copy_device_to_device

    if copy_through_kept(buffer_id, manifest, sources):  # a plain layout's buffer_id, "", is never mapped
        return
    with client.open_shared(client.export(buffer)) as mapped:
        copy_device_to_device(mapped.descriptor.device_uuid, device_copies(manifest, sources, mapped.ptr))


def copy_through_kept(buffer_id: str, manifest: Manifest, sources: Sequence[Source]) -> bool:
    """The device tensors copied into allocation ``buffer_id`` through this process's mapping of it (a version's
    buffer reused: no request, no fd); False, nothing copied, where this process does not map it."""
    from cuctxd.client.data_plane.ipc_cuda import copy_device_to_device

    leased = VMM_IMPORTS.lease(buffer_id)
    if leased is None:
        return False
    opening, device_uuid = leased
    try:
        copy_device_to_device(device_uuid, device_copies(manifest, sources, opening.ptr))
    finally:
        opening.close()
    return True


__all__ = ["RawBytes", "layout_offsets", "plan_layout", "publish_layout", "publish_tensors"]
