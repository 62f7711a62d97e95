"""A layout's copies on several devices, and the caller's own GPU (PROTOCOL.md, section 9, "Copies on several
devices").

A name holds one copy per device. A copy is filled from one that exists, on the GPU: this process maps both
(the source share and the new buffer, allocated on the target device) and copies between them
(``cuMemcpyPeer`` on cuda; a memory copy on the sim), so the checkpoint is read from its files once and no
daemon worker is stalled by the copy. The copy is then published with the name's manifest, so it has its digest.

:func:`caller_device` is the daemon's ordinal of the device this process uses, matched by UUID (ordinals
differ between the daemon and a process under ``CUDA_VISIBLE_DEVICES``, or in a pod given one GPU): on cuda
the device torch or CuPy has current (when either is imported), else this thread's current context's, else
the process's first GPU; on the sim, the first entry of ``CUCTXD_SIM_VISIBLE_DEVICES`` (a sim device's UUID,
as ``cuctx devices`` lists it, or the daemon's ordinal), the sim's stand-in for ``CUDA_VISIBLE_DEVICES``; a sim
process without it has no device of its own. Which thread may call: the client's callers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.api.objects import Buffer
from cuctxd.client.wire import build
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import BadArgument, CudaError, NoCopy, NotShareable
from cuctxd.protos.records import ShareDescriptor
from cuctxd.protos.sizes import human_size

#: The sim client's visible devices: comma-separated sim device UUIDs or daemon ordinals, the first the current.
SIM_VISIBLE_DEVICES = "CUCTXD_SIM_VISIBLE_DEVICES"
#: Bytes copied at a time between two sim copies.
_SIM_CHUNK = 64 << 20


def caller_device(client: Client) -> int | None:
    """The daemon's ordinal of this process's current device (module docstring), None where a sim process names
    none; :class:`NotShareable` where the daemon does not serve it."""
    wanted = _current_device_uuid(client.backend)
    if wanted is None:
        return None
    devices = client.devices()
    for info in devices:
        if wanted in (info.uuid, str(info.index)):
            return int(info.index)
    served = ", ".join(f"{info.index} ({info.uuid})" for info in devices)
    raise NotShareable(f"this process's device {wanted} is not one the daemon serves (it serves {served})")


def _current_device_uuid(backend: str) -> str | None:
    if backend == "sim":
        first = os.environ.get(SIM_VISIBLE_DEVICES, "").split(",")[0].strip()
        return first or None
    from cuctxd.client.data_plane.ipc_cuda import current_device_uuid, device_uuid

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return device_uuid(int(torch.cuda.current_device()))
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return device_uuid(int(cupy.cuda.runtime.getDevice()))
    return current_device_uuid()


#: Where a layout goes: a device; several (the first read or filled, the others copies of it, filled from it on
#: the GPU); ``"all"``, ``"N,M"`` (:func:`parse_devices`); None: the session's current device.
Devices = int | Sequence[int] | str | None


def first_and_copies(client: Client, device: Devices) -> tuple[int | None, list[int]]:
    """``device`` as the device a layout is filled on and those that get copies of it, checked before anything is
    read (:func:`served_devices`)."""
    if device is None or isinstance(device, int):
        return device, []
    wanted = parse_devices(device) if isinstance(device, str) else _each_once(device, f"device={device!r}")
    devices = served_devices(wanted, len(client.devices()))
    if not devices:
        raise BadArgument("a layout is published on at least one device")
    return devices[0], devices[1:]


def parse_devices(text: str) -> list[int] | None:
    """``--device``'s value as written: None for ``all`` (every device the daemon has), else the numbers of ``N`` or
    ``N,M,...`` in that order (the first the one the checkpoint is read onto); :class:`BadArgument` for anything
    else. It asks no daemon, so that cuctx checks it while parsing its arguments."""
    if text == "all":
        return None
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise BadArgument(f"devices {text!r}: a device number, several separated by commas, or 'all'") from None
    return _each_once(devices, f"devices {text!r}")


def _each_once(devices: Sequence[int], said: str) -> list[int]:
    """``devices`` as a list; :class:`BadArgument` naming ``said`` where one is negative or named twice."""
    if any(device < 0 for device in devices):
        raise BadArgument(f"{said}: each device number must be 0 or more")
    if len(set(devices)) != len(devices):
        raise BadArgument(f"{said}: each device once")
    return list(devices)


def served_devices(devices: list[int] | None, count: int) -> list[int]:
    """``devices`` (None: each of the daemon's ``count``) where the daemon serves each; one it does not raises
    ``CUDA_ERROR_INVALID_DEVICE`` as the daemon would, before a byte is read for the others."""
    if devices is None:
        return list(range(count))
    for device in devices:
        if device >= count:
            raise CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE,
                               f"device {device}; this daemon serves {count} device(s)")
    return devices


def ensure_copy(client: Client, name: str, device: int, *, persistent: bool = True) -> ShareDescriptor:
    """``name``'s copy on ``device``: the one there, or a new one filled on the GPU from its first copy and
    published (allowed to whoever may unpublish the name: ``CUCTXD_ERROR_NOT_OWNER`` otherwise)."""
    try:
        descriptor: ShareDescriptor = client.lookup(name, device=device)
        return descriptor
    except NoCopy:
        pass
    first = client.lookup(name)
    return copy_share(client, name, first, device, first.manifest, persistent=persistent,
                      read_only=first.read_only).descriptor


class Copied:
    """A copy made by :func:`copy_share`: its published ``descriptor`` and its ``buffer`` (this session's)."""

    def __init__(self, descriptor: ShareDescriptor, buffer: Buffer) -> None:
        self.descriptor, self.buffer = descriptor, buffer


def copy_share(client: Client, name: str, source: ShareDescriptor, device: int, manifest: bytes, *,
               persistent: bool = True, read_only: bool = False, stage: bool = False) -> Copied:
    """A new buffer on ``device`` filled from the share ``source`` (mapped here) and published as ``name``'s copy
    there with ``manifest`` (``stage``: for this session's next publish of the name). The buffer is freed when
    this raises; a device without room raises ``CUDA_ERROR_OUT_OF_MEMORY`` naming it and the name."""
    try:
        buffer = client.alloc(source.size, device, shareable=True)
    except CudaError as error:
        if error.name != "CUDA_ERROR_OUT_OF_MEMORY":
            raise
        raise CudaError(error.code, error.name, f"device {device} has no room for the copy of {name!r} "
                        f"({human_size(source.size)}): {error.message}") from None
    try:
        with client.open_shared(source) as mapped_source, client.open_shared(client.export(buffer)) as target:
            _copy_mapped(target, mapped_source, source.size)
        published = client.run(build.publish(buffer, name, manifest, persistent, read_only, copy=not stage,
                                             stage=stage))
    except BaseException:
        buffer.free()
        raise
    return Copied(published, buffer)


def stage_copies(client: Client, name: str, buffer: Buffer, devices: Sequence[int], manifest: bytes, *,
                 persistent: bool, read_only: bool) -> list[Buffer]:
    """Copies of ``buffer`` (this session's, filled, not published yet) staged on ``devices`` for its publish as
    ``name``; returns their buffers. Frees the ones made when this raises (one device too full: none is left)."""
    staged: list[Buffer] = []
    if not devices:
        return staged
    source = client.export(buffer)
    try:
        for device in devices:
            staged.append(copy_share(client, name, source, device, manifest, persistent=persistent,
                                     read_only=read_only, stage=True).buffer)
    except BaseException:
        for made in staged:
            made.free()
        raise
    return staged


def _copy_mapped(target: Any, source: Any, size: int) -> None:
    """``size`` bytes from one mapped share to another, on another device: a peer copy on cuda, in chunks on the
    sim."""
    if source.backend == "cuda":
        from cuctxd.client.data_plane.ipc_cuda import copy_between_devices

        copy_between_devices(target.descriptor.device_uuid, target.ptr, source.descriptor.device_uuid,
                             source.ptr, size)
        return
    into, out_of = target.host_view(), source.host_view()
    for start in range(0, size, _SIM_CHUNK):
        into[start:start + _SIM_CHUNK] = out_of[start:start + _SIM_CHUNK]


__all__ = ["SIM_VISIBLE_DEVICES", "Devices", "caller_device", "ensure_copy", "first_and_copies", "parse_devices",
           "served_devices", "stage_copies"]
