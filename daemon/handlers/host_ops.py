"""Data-plane ops, run on the device's worker thread: host_alloc, host_free, memcpy_htod, memcpy_dtoh,
shm_lane."""

from __future__ import annotations

from cuctxd.daemon.backends.base import Stream
from cuctxd.daemon.device.entries import Buffer, HostBuffer, SessionOnDevice, check_range
from cuctxd.daemon.device.host import MakingHost
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.registry import device_handler
from cuctxd.daemon.handlers.replies import Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos import pinned_ops as ops
from cuctxd.protos.shm_lane import REGION_BYTES


@device_handler(ops.HostAlloc)
def host_alloc(state: DeviceState, job: Job[ops.HostAlloc]) -> Reply | Pending:
    session = state.session(job.session)
    # In the session's primary context, whatever is current: registered portable, a host buffer serves every
    # context of the device, so it must not go with a context the session creates and destroys.
    made = state.host.alloc(session, state.contexts.bind_primary(session), job.args.size, job.args.reuse)
    if not isinstance(made, MakingHost):
        return _hand_over(state, job, session, *made)
    making = made  # a new one: registered once the helper thread has its memfd in 2 MiB pages

    def registered() -> Reply:
        return _hand_over(state, job, session,
                          *state.host.finish(making, state.sessions.get(job.session.token) is session))

    return Pending(making.collapsing.done, registered)


def _hand_over(state: DeviceState, job: Job, session: SessionOnDevice, entry: HostBuffer, fd: int) -> Reply:
    """The reply to ``host_alloc``: a ticket for the buffer's fd (the buffer is freed if none can be had)."""
    try:
        ticket = state.tickets.issue(job.session.token, job.session.uid, [fd], {"host": entry.handle},
                                     job.session.fd_peer)
    except BaseException:
        state.host.free(session, entry)
        raise
    return Reply({"host": entry.handle, "size": entry.size, "device": job.device, "ticket": ticket,
                  "huge_page_bytes": entry.huge_page_bytes})


@device_handler(ops.ShmLane)
def shm_lane(state: DeviceState, job: Job[ops.ShmLane]) -> Reply:
    state.session(job.session)  # the lane closes with the session's state here
    fds = state.shm_lanes.open(job.session)
    try:
        ticket = state.tickets.issue(job.session.token, job.session.uid, fds, {"shm_lane": job.device},
                                     job.session.fd_peer)
    except BaseException:
        state.shm_lanes.close(job.session.token)
        raise
    return Reply({"ticket": ticket, "size": REGION_BYTES})


@device_handler(ops.HostFree)
def host_free(state: DeviceState, job: Job[ops.HostFree]) -> Reply | Pending:
    session = state.session(job.session)
    entry = session.host_buffers[job.args.host]

    def free() -> Reply:
        state.host.free(session, entry)
        return Reply()

    if state.host.idle(entry):
        return free()
    return Pending(lambda: state.host.idle(entry), free)


def _checked(state: DeviceState, job: Job) -> tuple[SessionOnDevice, Buffer, HostBuffer, int, Stream | None]:
    """The copy's session, buffer, host buffer, size and stream, each checked."""
    args = job.args
    session = state.session(job.session)
    buffer = session.buffers[args.buffer]
    entry = session.host_buffers[args.host]
    size = check_range(entry.size, args.host_offset, args.size)
    check_range(buffer.size, args.offset, size)
    stream = state.streams.stream_of(session, args.stream)  # checked even when there is nothing to do
    return session, buffer, entry, size, stream


def _copy(state: DeviceState, job: Job, to_device: bool) -> Reply:
    args = job.args
    session, buffer, entry, size, stream = _checked(state, job)
    if not size:
        return Reply({"size": 0})
    host = entry.view[args.host_offset:args.host_offset + size]
    ptr = buffer.ptr + args.offset
    if stream is None:
        state.activate(buffer.context)
        if to_device:
            state.driver.memcpy_htod(ptr, host, size)
        else:
            state.driver.memcpy_dtoh(host, ptr, size)
        return Reply({"size": size})
    if to_device:
        state.driver.memcpy_htod_async(ptr, host, size, stream)
    else:
        state.driver.memcpy_dtoh_async(host, ptr, size, stream)
    stream_entry = session.streams[args.stream]
    state.host.mark_busy(entry, state.streams.marker_on(stream_entry.context, stream))
    return Reply({"size": size})


@device_handler(ops.MemcpyHtoD)
def memcpy_htod(state: DeviceState, job: Job[ops.MemcpyHtoD]) -> Reply | Pending:
    lane = job.shm
    if lane is not None and lane.early and not lane.rung:  # its bytes are still being copied in
        _checked(state, job)  # errors now; the copy, checked again, on the lane's data ring
        return Pending(lambda: True, lambda: _copy(state, job, to_device=True), on_ring=lane)
    return _copy(state, job, to_device=True)


@device_handler(ops.MemcpyDtoH)
def memcpy_dtoh(state: DeviceState, job: Job[ops.MemcpyDtoH]) -> Reply:
    return _copy(state, job, to_device=False)
