"""The synchronous client: one session with the daemon, with CUDA's names and semantics.

A new :class:`Client` is like a new CUDA host thread: no current context on any
device until :meth:`Client.set_device`, :meth:`Client.create_context`, or a
runtime-style call (``alloc``, ``synchronize``, ``mem_get_info`` ...) binds the
device's primary context. Calls are thread-safe (serialised on one socket).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from client.lease import Heartbeat
from client.objects import Buffer, Context
from client.pipeline import Pipeline
from client.sharing import OpenedShare, check_same_host, map_share
from client.streams import Event, Stream
from client.transport import DEFAULT_TIMEOUT, Call, Transport
from protos.endpoints import client_endpoint
from protos.errors import CuctxError, TooLarge
from protos.records import DeviceInfo, ShareDescriptor
from protos.version import PROTOCOL_VERSION

#: Writes and reads larger than two of these travel as pipelined chunks of this size.
CHUNK_BYTES = 4 << 20


def _handle(stream: Stream | None) -> int | None:
    return None if stream is None else stream.handle


def _size_of(result: dict[str, Any], frames: list[Any]) -> int:
    return int(result["size"])


class Client:
    """A session with a cuctxd daemon.

    ``endpoint``: the argument, else ``$CUCTXD_ENDPOINT``, else the per-user
    default ipc:// socket. ``timeout``: seconds any call waits before raising
    :class:`~protos.errors.DaemonTimeout`. Use as a context manager, or call
    :meth:`close`, so the daemon frees the session's contexts and memory. A
    background thread renews the session's lease; ``heartbeat=False`` turns it
    off (the session then ends ``lease_ttl`` seconds after its last call).
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 name: str | None = None, heartbeat: bool = True) -> None:
        self.endpoint = client_endpoint(endpoint)
        self._transport = Transport(self.endpoint, timeout)
        self._token: str | None = None
        try:
            hello = self._call("hello", protocol=PROTOCOL_VERSION,
                               client=name or os.path.basename(sys.argv[0] or "python"), pid=os.getpid())
        except BaseException:
            self._transport.close()
            raise
        self._token = hello["session"]
        self.session_id: int = hello["session_id"]
        self.daemon_version: str = hello["daemon_version"]
        self.protocol: int = hello["protocol"]
        self.backend: str = hello["backend"]
        self.limits: dict[str, int] = hello["limits"]
        self.lease_ttl: float = hello["lease_ttl"]
        self._heartbeat = Heartbeat(self.endpoint, self._token, self.lease_ttl) if heartbeat else None

    # --- plumbing -------------------------------------------------------------------

    def _call(self, op: str, payload: tuple[Any, ...] = (), into: Any = None, **args: Any) -> dict[str, Any]:
        result, _ = self._call_frames(op, payload, into, **args)
        return result

    def _call_frames(self, op: str, payload: tuple[Any, ...] = (), into: Any = None,
                     **args: Any) -> tuple[dict[str, Any], list[Any]]:
        wire_args = {k: v for k, v in args.items() if v is not None}
        return self._transport.call(op, wire_args, self._token, payload, into=into)

    def _send(self, op: str, payload: tuple[Any, ...], convert: Any, into: Any = None, **args: Any) -> Call[Any]:
        wire_args = {k: v for k, v in args.items() if v is not None}
        return self._transport.send(op, wire_args, self._token, payload, into=into, convert=convert)

    def pipeline(self) -> Pipeline:
        """Send memory ops without waiting for each reply (see :mod:`client.pipeline`)."""
        return Pipeline(self)

    def close(self) -> None:
        """End the session (the daemon frees its contexts and memory) and the connection."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        try:
            if self._token is not None:  # a daemon that is gone must not hold the caller for long
                self._transport.call("goodbye", {}, self._token, timeout=min(self._transport.timeout, 2.0))
        except CuctxError:
            pass  # the daemon is gone or already forgot us: nothing left to free
        finally:
            self._token = None
            self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- daemon and devices -----------------------------------------------------------

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._call("ping")
        return time.perf_counter() - start

    def device_count(self) -> int:
        """``cudaGetDeviceCount``: creates no context."""
        return int(self._call("device_count")["count"])

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo.from_wire(d) for d in self._call("devices")["devices"]]

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def get_device(self) -> int:
        """``cudaGetDevice``: the session's current device."""
        return int(self._call("get_device")["device"])

    def set_device(self, device: int) -> Context:
        """``cudaSetDevice``: binds the device's primary context as current; returns it."""
        return Context.from_wire(self, self._call("set_device", device=device)["context"])

    # --- contexts -------------------------------------------------------------------

    def current_context(self, device: int | None = None) -> Context | None:
        """``cuCtxGetCurrent``; None while the session's stack on ``device`` is empty."""
        wire = self._call("current_context", device=device)["context"]
        return None if wire is None else Context.from_wire(self, wire)

    def context_stack(self, device: int | None = None) -> list[Context]:
        """The session's context stack on ``device``, bottom first."""
        return [Context.from_wire(self, w) for w in self._call("context_stack", device=device)["stack"]]

    def create_context(self, device: int | None = None, flags: int = 0) -> Context:
        """``cuCtxCreate``: a new context, pushed and current on ``device``."""
        return Context.from_wire(self, self._call("create_context", device=device, flags=flags)["context"])

    def push_context(self, context: Context) -> None:
        self._call("push_context", device=context.device, context=context.handle)

    def pop_context(self, device: int | None = None) -> Context:
        """``cuCtxPopCurrent``: returns the popped context."""
        return Context.from_wire(self, self._call("pop_context", device=device)["context"])

    def destroy_context(self, context: Context) -> None:
        self._call("destroy_context", device=context.device, context=context.handle)

    def context_info(self, context: Context) -> Context:
        return Context.from_wire(
            self, self._call("context_info", device=context.device, context=context.handle)["context"]
        )

    def synchronize(self, device: int | None = None) -> None:
        """``cuCtxSynchronize`` on the current context (binds the primary if there is none)."""
        self._call("synchronize", device=device)

    def device_synchronize(self, device: int | None = None) -> None:
        """Wait for every context alive on ``device``, this session's and others'."""
        self._call("device_synchronize", device=device)

    # --- memory ---------------------------------------------------------------------

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        """``cuMemGetInfo``: (free, total) bytes."""
        result = self._call("mem_get_info", device=device)
        return int(result["free"]), int(result["total"])

    def memory_info(self, device: int | None = None) -> dict[str, Any]:
        """The whole ``mem_get_info`` answer: ``free`` and ``total`` as this session sees them,
        plus ``device_free``, ``quota``, ``reserve`` and ``limited_by`` ("quota" or "device")."""
        return self._call("mem_get_info", device=device)

    def alloc(self, size: int, device: int | None = None, *, shareable: bool = False) -> Buffer:
        """Device memory in the current context of ``device`` (default: the current device).

        By default it comes from the context's stream-ordered pool (fast); pass
        ``shareable=True`` for ``cuMemAlloc`` memory, which other processes can open.
        """
        wire = self._call("alloc", size=size, device=device, shareable=shareable)["buffer"]
        return Buffer.from_wire(self, wire)

    def free(self, buffer: Buffer) -> None:
        self._call("free", device=buffer.device, buffer=buffer.handle)

    def fill(self, buffer: Buffer, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> None:
        self._call("fill", device=buffer.device, buffer=buffer.handle, value=value, offset=offset, size=size,
                   stream=_handle(stream))

    def write(self, buffer: Buffer, data: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Host to device. Large writes go as pipelined chunks, so the transfer of one chunk
        overlaps the device copy of the one before."""
        view = memoryview(data).cast("B")
        frame = view.nbytes if view.nbytes <= 2 * CHUNK_BYTES else CHUNK_BYTES
        if frame > self.limits["max_payload_bytes"]:
            raise TooLarge(f"a {frame}-byte payload frame exceeds the daemon's limit of "
                           f"{self.limits['max_payload_bytes']} bytes", "write")
        if view.nbytes <= 2 * CHUNK_BYTES:
            result = self._call("write", (view,), device=buffer.device, buffer=buffer.handle, offset=offset,
                                stream=_handle(stream))
            return int(result["size"])
        with self.pipeline() as chunks:
            calls = [chunks.write(buffer, view[at:at + CHUNK_BYTES], offset + at, stream=stream)
                     for at in range(0, view.nbytes, CHUNK_BYTES)]
        return sum(call.result() for call in calls)

    def read(self, buffer: Buffer, size: int | None = None, offset: int = 0, *,
             stream: Stream | None = None) -> bytes:
        size = buffer.size - offset if size is None else size
        if 2 * CHUNK_BYTES < size <= buffer.size - offset:  # out-of-range sizes: the daemon says why
            out = bytearray(size)
            self.read_into(buffer, out, offset, stream=stream)
            return bytes(out)
        _, frames = self._call_frames("read", device=buffer.device, buffer=buffer.handle,
                                      offset=offset, size=size, stream=_handle(stream))
        return frames[0].bytes if frames else b""

    def read_into(self, buffer: Buffer, out: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Device to host straight into ``out`` (``recv_into``), in pipelined chunks when large."""
        view = memoryview(out).cast("B")
        calls = [
            self._send("read", (), _size_of, view[at:at + CHUNK_BYTES], device=buffer.device,
                       buffer=buffer.handle, offset=offset + at, size=min(CHUNK_BYTES, view.nbytes - at),
                       stream=_handle(stream))
            for at in range(0, max(view.nbytes, 1), CHUNK_BYTES)
        ]
        return sum(call.result() for call in calls)

    def copy(self, src: Buffer, dst: Buffer, size: int | None = None, src_offset: int = 0,
             dst_offset: int = 0, *, stream: Stream | None = None) -> int:
        result = self._call("copy", device=src.device, dst_device=dst.device, src=src.handle,
                            dst=dst.handle, size=size, src_offset=src_offset, dst_offset=dst_offset,
                            stream=_handle(stream))
        return int(result["size"])

    # --- streams and events -----------------------------------------------------------------

    def create_stream(self, device: int | None = None, *, non_blocking: bool = False) -> Stream:
        """``cuStreamCreate`` in the current context of ``device`` (binds the primary lazily)."""
        result = self._call("create_stream", device=device, non_blocking=non_blocking)
        return Stream(self, result["stream"], self._device_or_current(device))

    def create_event(self, device: int | None = None, *, timing: bool = True) -> Event:
        result = self._call("create_event", device=device, timing=timing)
        return Event(self, result["event"], self._device_or_current(device))

    def _device_or_current(self, device: int | None) -> int:
        return self.get_device() if device is None else device

    # --- sharing between processes --------------------------------------------------------

    def export(self, buffer: Buffer) -> ShareDescriptor:
        """Make ``buffer`` shareable; the descriptor is plain data another process can open."""
        wire = self._call("export", device=buffer.device, buffer=buffer.handle)["share"]
        return ShareDescriptor.from_wire(wire)

    def publish(self, buffer: Buffer, name: str) -> ShareDescriptor:
        """Export ``buffer`` and publish it under ``name`` for every session to look up."""
        wire = self._call("publish", device=buffer.device, buffer=buffer.handle, name=name)["share"]
        return ShareDescriptor.from_wire(wire)

    def unpublish(self, name: str) -> None:
        self._call("unpublish", name=name)

    def lookup(self, name: str) -> ShareDescriptor:
        return ShareDescriptor.from_wire(self._call("lookup", name=name)["share"])

    def list_shared(self) -> list[dict[str, Any]]:
        """Published names with their device, size, owner and number of holders."""
        shared: list[dict[str, Any]] = self._call("list_shared")["shared"]
        return shared

    def open_shared(self, share: str | ShareDescriptor) -> OpenedShare:
        """Hold a share (by name or descriptor) and map it in this process; close it when done."""
        descriptor = self.lookup(share) if isinstance(share, str) else share
        check_same_host(descriptor)
        wire = self._call("open_shared", device=descriptor.device, share_id=descriptor.share_id)["share"]
        descriptor = ShareDescriptor.from_wire({**wire, "name": descriptor.name})
        try:
            mapping = map_share(descriptor)
        except BaseException:
            self.close_shared(descriptor)
            raise
        return OpenedShare(self, descriptor, mapping)

    def close_shared(self, descriptor: ShareDescriptor) -> None:
        """Drop this session's hold (``OpenedShare.close`` calls this after unmapping)."""
        self._call("close_shared", device=descriptor.device, share_id=descriptor.share_id)
