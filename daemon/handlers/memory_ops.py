"""Memory ops, run on the device's worker thread: alloc, free, fill, write, read, copy, mem_get_info,
stream_ordered."""

from __future__ import annotations

import struct

from cuctxd.daemon.device.entries import check_range
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.streams import STAGED_READ_MAX
from cuctxd.daemon.handlers.registry import device_handler
from cuctxd.daemon.handlers.replies import Forward, Pending, Reply, after_markers
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos import ops
from cuctxd.protos.errors import BadArgument, CuctxError, TooLarge
from cuctxd.protos.limits import MAX_HANDLE, MAX_STREAM_ORDERED_ENTRIES, MIN_CLIENT_HANDLE, STREAM_ORDERED_ENTRY


@device_handler(ops.MemGetInfo)
def mem_get_info(state: DeviceState, job: Job[ops.MemGetInfo]) -> Reply:
    session = state.session(job.session)
    state.activate(state.contexts.current_or_primary(session))
    return Reply(state.memory.info(session))


@device_handler(ops.Alloc)
def alloc(state: DeviceState, job: Job[ops.Alloc]) -> Reply:
    """``version_of``: a shareable buffer for that name's next version, its spare where it fits; the reply says
    its ``buffer_id`` and the name's ``buffers`` (PROTOCOL.md, "Versions")."""
    session = state.session(job.session)
    context = state.contexts.for_new(session, "buffer")
    name = job.args.version_of
    if name is None:
        buffer = state.memory.alloc(session, context, job.args.size, job.args.shareable)
        return Reply({"buffer": state.memory.record(buffer).to_wire()})
    if not name:
        raise BadArgument("alloc's version_of needs a non-empty name")
    buffer = state.memory.alloc_version(session, context, job.args.size, name)
    return Reply({"buffer": state.memory.record(buffer).to_wire(), "buffer_id": buffer.buffer_id,
                  "buffers": list(state.registry.buffers(name))})


@device_handler(ops.Free)
def free(state: DeviceState, job: Job[ops.Free]) -> Reply:
    session = state.session(job.session)
    state.memory.free(session, session.buffers[job.args.buffer], unpublish=True)
    return Reply()


@device_handler(ops.Fill)
def fill(state: DeviceState, job: Job[ops.Fill]) -> Reply:
    session = state.session(job.session)
    buffer = session.buffers[job.args.buffer]
    size = check_range(buffer.size, job.args.offset, job.args.size)
    stream = state.streams.stream_of(session, job.args.stream)  # checked even when there is nothing to do
    if size:
        if stream is None:
            state.activate(buffer.context)
            state.driver.memset_d8(buffer.ptr + job.args.offset, job.args.value, size)
        else:
            state.driver.memset_d8_async(buffer.ptr + job.args.offset, job.args.value, size, stream)
    return Reply({"size": size})


@device_handler(ops.Write)
def write(state: DeviceState, job: Job[ops.Write]) -> Reply | Pending:
    session = state.session(job.session)
    buffer = session.buffers[job.args.buffer]
    data = memoryview(job.payload[0])
    size = check_range(buffer.size, job.args.offset, data.nbytes)
    if job.args.stream is not None:
        session.streams[job.args.stream]  # checked even when there is nothing to do
    if not size:
        return Reply({"size": 0})
    if job.args.stream is None:
        state.activate(buffer.context)
        state.driver.memcpy_htod(buffer.ptr + job.args.offset, data, size)
        return Reply({"size": size})
    stream_entry = session.streams[job.args.stream]
    state.activate(stream_entry.context)
    state.driver.memcpy_htod_async(buffer.ptr + job.args.offset, data, size, stream_entry.stream)
    # The payload frame must outlive the copy: the reply (and the job holding it) waits for it.
    marker = state.streams.marker_on(stream_entry.context, stream_entry.stream)
    return after_markers(state.streams, [marker], Reply({"size": size}))


@device_handler(ops.Read)
def read(state: DeviceState, job: Job[ops.Read]) -> Reply | Pending:
    session = state.session(job.session)
    buffer = session.buffers[job.args.buffer]
    size = check_range(buffer.size, job.args.offset, job.args.size)
    if size > state.limits.max_payload:
        raise TooLarge(f"a read of {size} bytes exceeds the payload limit of {state.limits.max_payload}")
    if job.args.stream is not None:
        session.streams[job.args.stream]  # checked even when there is nothing to do
    if not size:
        return Reply({"size": 0}, [b""])
    if job.args.stream is None and size <= STAGED_READ_MAX:
        return Reply({"size": size}, [state.streams.staged_read(buffer.context, buffer.ptr + job.args.offset, size)])
    out = bytearray(size)
    if job.args.stream is None:
        state.activate(buffer.context)
        state.driver.memcpy_dtoh(memoryview(out), buffer.ptr + job.args.offset, size)
        return Reply({"size": size}, [out])
    stream_entry = session.streams[job.args.stream]
    state.activate(stream_entry.context)
    state.driver.memcpy_dtoh_async(memoryview(out), buffer.ptr + job.args.offset, size, stream_entry.stream)
    marker = state.streams.marker_on(stream_entry.context, stream_entry.stream)
    return after_markers(state.streams, [marker], Reply({"size": size}, [out]))


@device_handler(ops.Copy)
def copy(state: DeviceState, job: Job[ops.Copy]) -> Reply | Forward:
    args: ops.Copy = job.args
    session = state.session(job.session)
    src = session.buffers[args.src]
    size = check_range(src.size, args.src_offset, args.size)
    dst_device = job.device if args.dst_device is None else args.dst_device
    if dst_device == job.device:
        dst = session.buffers[args.dst]
        check_range(dst.size, args.dst_offset, size)
        stream = state.streams.stream_of(session, args.stream)  # checked even when there is nothing to do
        if size:
            if stream is None:
                state.activate(src.context)
                state.driver.memcpy_dtod(dst.ptr + args.dst_offset, src.ptr + args.src_offset, size)
            else:
                state.driver.memcpy_dtod_async(dst.ptr + args.dst_offset, src.ptr + args.src_offset, size, stream)
        return Reply({"size": size})
    if args.stream is not None:
        raise BadArgument("a copy between devices cannot be stream-ordered (it is staged through the daemon)")
    if size > state.limits.max_payload:
        raise TooLarge(f"a copy between devices of {size} bytes exceeds the payload limit "
                       f"of {state.limits.max_payload} (it is staged through host memory)")
    # Across devices, each worker touches only its own device: stage through host memory.
    staged = bytearray(size)
    if size:
        state.activate(src.context)
        state.driver.memcpy_dtoh(memoryview(staged), src.ptr + args.src_offset, size)

    def finish_on_destination(dst_state: DeviceState) -> Reply:
        dst = dst_state.session(job.session).buffers[args.dst]
        check_range(dst.size, args.dst_offset, size)
        if size:
            dst_state.activate(dst.context)
            dst_state.driver.memcpy_htod(dst.ptr + args.dst_offset, memoryview(staged), size)
        return Reply({"size": size})

    return Forward(dst_device, finish_on_destination)


_ALLOC, _FREE = 1, 2
_ENTRY = struct.Struct(STREAM_ORDERED_ENTRY)


@device_handler(ops.StreamOrdered)
def stream_ordered(state: DeviceState, job: Job[ops.StreamOrdered]) -> Reply:
    """Run each entry in order; one that fails is deferred to its handle (SessionOnDevice.defer)."""
    args: ops.StreamOrdered = job.args
    if len(args.ops) % _ENTRY.size:
        raise BadArgument(f"stream_ordered ops must be whole {_ENTRY.size}-byte entries, got {len(args.ops)} bytes")
    if len(args.ops) // _ENTRY.size > MAX_STREAM_ORDERED_ENTRIES:
        raise TooLarge(f"stream_ordered takes at most {MAX_STREAM_ORDERED_ENTRIES} entries")
    session = state.session(job.session)
    stream_entry = None if args.stream is None else session.streams[args.stream]
    stream = None if stream_entry is None else stream_entry.stream
    done = failed = 0
    for kind, handle, size in _ENTRY.iter_unpack(args.ops):
        try:
            if kind == _ALLOC:
                if not MIN_CLIENT_HANDLE <= handle <= MAX_HANDLE or handle in session.buffers:
                    raise BadArgument(f"stream-ordered allocation handle {handle:#x} is in use or outside "
                                      f"[{MIN_CLIENT_HANDLE:#x}, {MAX_HANDLE:#x}]")
                context = state.contexts.for_new(session, "buffer")
                if stream_entry is not None:
                    context = stream_entry.context
                state.memory.alloc(session, context, size, False, handle=handle, stream=stream)
            elif kind == _FREE:
                buffer = session.buffers[handle]
                if stream_entry is not None:
                    state.activate(stream_entry.context)
                state.memory.free(session, buffer, unpublish=True, stream=stream)
            else:
                raise BadArgument(f"stream_ordered entry kind {kind} is neither 1 (alloc) nor 2 (free)")
            done += 1
        except CuctxError as error:
            session.defer(handle, error)
            failed += 1
    return Reply({"done": done, "failed": failed})
