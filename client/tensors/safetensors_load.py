"""Loading a safetensors checkpoint (a file, a directory of shards, an index) as one layout (``cuctx load``).

:func:`load_safetensors` reads and checks the checkpoint (:mod:`cuctxd.client.tensors.checkpoints`) before
anything is allocated, lays its tensors out as every layout is
(:func:`~cuctxd.client.tensors.publishing.layout_offsets`), reads every shard into one shareable daemon
buffer, hashed on the way (:func:`~cuctxd.client.data_plane.file_reads.load_into_new_buffer`), and publishes it
with its manifest and digests. A name in use is compared by content: where the published layout has the
same tensors, the files are hashed (mapped, on threads) and, the same as its digest and the daemon vouching
for that digest (``verify_shared``: another user's is hashed on the device), nothing is loaded; other
content is refused, naming who holds the name, unless ``replace``, which loads into a new buffer (no hashing
first: a replace mostly brings new content) and swaps the name in the daemon at once, or, the loaded digest
the same as the published one and vouched for, frees the new buffer and swaps nothing. Nothing stays
published or allocated after a failure. Which thread may call: the client's callers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from cuctxd.client.api.client import Client
from cuctxd.client.api.objects import Buffer
from cuctxd.client.data_plane.file_reads import FileRange, load_into_new_buffer
from cuctxd.client.tensors.checkpoints import Checkpoint, open_regular, read_checkpoint
from cuctxd.client.tensors.copies import Devices, ensure_copy, first_and_copies
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.tensors.publishing import layout_offsets, no_room, publish_filled
from cuctxd.client.wire import build
from cuctxd.protos import digests
from cuctxd.protos.errors import (
    BadArgument,
    CuctxError,
    CudaError,
    DigestMismatch,
    LimitExceeded,
    NameExists,
    NoCopy,
    NoDaemon,
    NotFound,
    SessionLost,
    UnknownSession,
)
from cuctxd.protos.layouts import Manifest, TensorSpec, c_strides, check_manifest
from cuctxd.protos.records import ShareDescriptor


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_safetensors` did: the layout's ``descriptor`` (with its manifest), its ``digest``
    (None when loaded with ``digest=False``), whether it ``loaded`` (False: the name already held this
    content, and nothing was read), whether it ``replaced`` other content under the name, and the devices it
    ``copied`` the name's content to from a copy it had already (on the GPU, not from the files)."""

    descriptor: ShareDescriptor
    digest: str | None
    loaded: bool
    replaced: bool = False
    copied: tuple[int, ...] = ()


def load_safetensors(client: Client, path: str, name: str, *, device: Devices = None,
                     progress: Callable[[int, int], None] | None = None, read_only: bool = False,
                     replace: bool = False, digest: bool = True, version: bool = False) -> Loaded:
    """Publish the checkpoint at ``path`` (a ``.safetensors`` file, a directory, or an index JSON) as
    ``name`` on ``device`` (several: a copy on each, the checkpoint read onto the first and the others filled
    from it on the GPU, all published in one step; a name present elsewhere with this content gets copies on
    the devices it lacks, filled from its first copy); ``progress(done, total)`` in bytes, once for the whole
    checkpoint; ``read_only``: consumers may open it only read-only. A name in use: the same content is a no-op
    (``loaded`` False, with or without ``replace``), other content :class:`NameExists` unless ``replace``
    (allowed to whoever may unpublish the name). ``digest=False`` leaves the digests out of the manifest
    (for measuring). ``version``: publish it as the name's next version, whatever the name holds (the same
    content too). Raises :class:`BadArgument` for a checkpoint that cannot load (nothing allocated then),
    ``CudaError`` ``CUDA_ERROR_OUT_OF_MEMORY`` for a device without room."""
    return load_checkpoint(client, read_checkpoint(path), name, device=device, progress=progress,
                           read_only=read_only, replace=replace, digest=digest, version=version)


def load_checkpoint(client: Client, checkpoint: Checkpoint, name: str, *, device: Devices = None,
                    progress: Callable[[int, int], None] | None = None, read_only: bool = False,
                    replace: bool = False, digest: bool = True, version: bool = False) -> Loaded:
    """:func:`load_safetensors` of a checkpoint read already (one tensor-parallel rank's parts, say)."""
    path = checkpoint.path
    offsets, size = layout_offsets(tensor.nbytes for tensor in checkpoint.tensors)
    manifest = Manifest(tuple(TensorSpec(t.name, t.dtype, t.shape, c_strides(t.shape), offset)
                              for t, offset in zip(checkpoint.tensors, offsets, strict=True)), checkpoint.metadata)
    _check_layout(path, manifest, size)
    first, copies = first_and_copies(client, device)
    published = _published(client, name)
    if published is not None and not (replace or version):
        return _with_copies(client, name, _same_content(client, checkpoint, manifest, name, published), device)
    known = _manifest_of(published)
    theirs = None if known is None else known.digest
    first = client.get_device() if first is None else first
    _refuse_before_reading(client, path, size, first, len(manifest.tensors), orphans=published is None)
    with _opened(checkpoint) as fds:
        ranges = [FileRange(fds[t.shard], t.offset, t.nbytes, offset)
                  for t, offset in zip(checkpoint.tensors, offsets, strict=True)]

        try:  # the buffer is made while the first chunks are read
            with load_into_new_buffer(client, build.alloc(client, Buffer, size, first, True), first, ranges,
                                      digest=digest, progress=progress) as (buffer, found):
                if (published is not None and theirs is not None and digest and not version
                        and _layout_digest(checkpoint, cast(list[str], found)) == theirs
                        and _vouched(client, name, published, theirs)):
                    buffer.free()  # a replace by the same content: nothing to swap
                    return _with_copies(client, name, Loaded(published, theirs, False), device)
                descriptor = publish_filled(client, name, manifest, buffer, found, read_only=read_only,
                                            replace=replace and not version, copies=copies, version=version)
        except CudaError as error:
            raise no_room(client, error, size, first, len(manifest.tensors)) from None
        except SessionLost as lost:
            raise _went_away(client, path, lost) from lost.__cause__
        except CuctxError:  # the daemon's or the client's own (a timeout, a lost connection: OSErrors too)
            raise
        except (EOFError, OSError) as exc:
            raise BadArgument(f"{path}: reading the checkpoint failed: {exc}") from None
    return Loaded(descriptor, check_manifest(descriptor.manifest, descriptor.size).digest, True,
                  replaced=published is not None)


def _refuse_before_reading(client: Client, path: str, size: int, device: int, tensors: int, *, orphans: bool) -> None:
    """A load that would pass a limit, refused before a byte of the checkpoint is read, naming the setting to
    raise: the memory this session may take on ``device`` (``session_quota``, else the device's free memory
    less ``device_reserve``), and, for a new name (``orphans``), ``max_orphaned_bytes_per_uid`` (the layout
    outlives this session). The daemon
    still enforces both; this only saves reading a checkpoint that cannot stay."""
    memory = client.memory_info(device)
    if size > memory["free"]:
        setting = ("the daemon's session_quota (--session-quota)" if memory.get("limited_by") == "quota"
                   else "free memory on the device, or lower the daemon's device_reserve (--device-reserve)")
        raise no_room(client, CudaError(2, "CUDA_ERROR_OUT_OF_MEMORY", f"refused before reading {path}: raise "
                                        f"{setting}"), size, device, tensors)
    if not orphans:
        return
    state: dict[str, Any] = next((d for d in client.status().get("devices", []) if d.get("device") == device), {})
    limit = state.get("limits", {}).get("max_orphaned_bytes_per_uid")
    uid = os.getuid() if client.endpoint.startswith("ipc://") else None
    left = next((u["bytes"] for u in state.get("orphaned", {}).get("top_uids", []) if u["uid"] == uid), 0)
    if limit and left + size > limit:
        raise LimitExceeded(f"max_orphaned_bytes_per_uid: {path} needs {size} bytes on device {device}, and this "
                            f"user already leaves {left} of at most {limit} there in names whose owner is gone: "
                            "raise the daemon's max_orphaned_bytes_per_uid (--max-orphaned-bytes-per-uid), or "
                            "unpublish some first; nothing was read", "publish")


def _with_copies(client: Client, name: str, loaded: Loaded, devices: Devices) -> Loaded:
    """``loaded`` (the name held the content already), with a copy added on each of ``devices`` that lacks one,
    filled from the name's first copy on the GPU."""
    first, others = first_and_copies(client, devices)
    if first is None:
        return loaded
    copied = []
    for device in [first, *others]:
        try:
            client.lookup(name, device=device)
        except NoCopy:
            ensure_copy(client, name, device)
            copied.append(device)
    return dataclasses.replace(loaded, copied=tuple(copied))


def _check_layout(path: str, manifest: Manifest, size: int) -> None:
    """Refuse, naming ``path``, a checkpoint no layout can hold (its manifest too large), before anything else."""
    try:
        check_manifest(manifest.pack(), size)
    except BadArgument as exc:
        raise BadArgument(f"{path}: {exc.message}") from None


def _went_away(client: Client, path: str, lost: SessionLost) -> SessionLost:
    """``lost`` said for the load of ``path`` when the daemon went away during it (killed, crashed,
    restarted): no fault of the checkpoint's."""
    cause = lost.__cause__
    if isinstance(cause, NoDaemon):
        why = cause.message
    elif isinstance(cause, UnknownSession):
        why = f"the daemon at {client.endpoint} no longer knows this session (it was restarted)"
    else:
        return lost
    return SessionLost(f"{path}: the daemon went away during the load, which did not finish: {why}", lost.op)


def _published(client: Client, name: str) -> ShareDescriptor | None:
    try:
        descriptor: ShareDescriptor = client.lookup(name)
    except NotFound:
        return None
    return descriptor


def _manifest_of(published: ShareDescriptor | None) -> Manifest | None:
    """A published name's manifest, checked (None: no name, or no manifest)."""
    if published is None or not published.manifest:
        return None
    return check_manifest(published.manifest, published.size)


def _same_content(client: Client, checkpoint: Checkpoint, manifest: Manifest, name: str,
                  published: ShareDescriptor) -> Loaded:
    """A no-op (its :class:`Loaded`) when ``published`` holds the checkpoint's content, by a digest the daemon
    vouches for; else :class:`NameExists` naming who holds the name (and ``--replace`` where the content
    differs). The files are hashed only when the published layout has the same tensors, dtypes and shapes
    (else the content differs, known at once)."""
    known = _manifest_of(published)
    theirs = None if known is None else known.digest
    if known is None or theirs is None:
        raise NameExists(f"{name!r} is published already by {_holder(published)}, without a content digest to "
                         "compare this checkpoint with: load with --replace (replace=True) to swap it, or choose "
                         "another name")
    if sorted((t.name, t.dtype, t.shape) for t in known.tensors) != sorted(
            (t.name, t.dtype, t.shape) for t in manifest.tensors):  # in any order: one file and its shards alike
        differs = "this checkpoint has other tensors"
    else:
        ours = checkpoint_digest(checkpoint)
        if ours == theirs:
            try:
                client.verify_shared(name, theirs, published.device)
            except DigestMismatch as exc:
                raise NameExists(f"{name!r} is held by {_holder(published)}, whose bytes are not the content its "
                                 f"digest claims ({exc.message}): choose another name, or have its user "
                                 f"unpublish it") from None
            return Loaded(published, ours, False)
        differs = f"this checkpoint's {digests.short(ours)}"
    raise NameExists(f"{name!r} is held by {_holder(published)} with other content (digest {digests.short(theirs)}, "
                     f"{differs}): load with --replace (replace=True) to swap it")


def _vouched(client: Client, name: str, published: ShareDescriptor, digest: str) -> bool:
    """Whether the daemon vouches that ``name`` holds ``digest`` (its own user's word, or bytes it hashed): a
    replace by the same content is a no-op only then; other bytes under a claimed digest are replaced (or
    the replace refused, naming their publisher)."""
    try:
        client.verify_shared(name, digest, published.device)
    except DigestMismatch:
        return False
    return True


def _holder(published: ShareDescriptor) -> str:
    """Who published the name, as ``lookup`` says."""
    who = published.publisher or {}
    uid = "uid unknown" if who.get("uid") is None else f"uid {who['uid']}"
    return f"session {who.get('session')} ({who.get('client')!r}, {uid}, pid {who.get('pid')})"


def checkpoint_digest(checkpoint: Checkpoint) -> str:
    """The layout digest the checkpoint's content would have, its files mapped and hashed on threads."""
    mapped: list[mmap.mmap] = []
    try:
        with _opened(checkpoint) as fds:
            mapped.extend(mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for fd in fds)
        found = _hash_mapped(checkpoint, mapped)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"{checkpoint.path}: reading the checkpoint failed: {exc}") from None
    finally:
        for one in mapped:
            with contextlib.suppress(BufferError):  # a view still alive in a traceback: it goes with it
                one.close()
    return _layout_digest(checkpoint, found)


def _layout_digest(checkpoint: Checkpoint, found: Sequence[str]) -> str:
    """The layout digest of the checkpoint's tensors with the digests ``found`` of their bytes."""
    return digests.layout_digest((t.name, t.dtype, t.shape, found[index])
                                 for index, t in enumerate(checkpoint.tensors))


def _hash_mapped(checkpoint: Checkpoint, mapped: list[mmap.mmap]) -> list[str]:
    views = [memoryview(mapped[t.shard])[t.offset:t.offset + t.nbytes] for t in checkpoint.tensors]
    try:
        return hash_views(views)
    finally:
        for view in views:
            view.release()


@contextlib.contextmanager
def _opened(checkpoint: Checkpoint) -> Iterator[list[int]]:
    """Each shard open (read-only, still a regular file), the same size as when its header was read; closed on
    exit."""
    fds: list[int] = []
    try:
        for shard in checkpoint.shards:
            fds.append(open_regular(shard.path))
            if os.fstat(fds[-1]).st_size != shard.size:
                raise BadArgument(f"{shard.path}: changed while it was being loaded (it was {shard.size} bytes)")
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


__all__ = ["Loaded", "checkpoint_digest", "load_checkpoint", "load_safetensors"]
