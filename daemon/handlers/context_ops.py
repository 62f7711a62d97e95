"""Context ops, run on the device's worker thread: the runtime's set_device and the driver's cuCtx*."""

from __future__ import annotations

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.device.streams import Marker
from cuctxd.daemon.handlers.registry import device_handler
from cuctxd.daemon.handlers.replies import Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos import ops
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError


@device_handler(ops.SetDevice)
def set_device(state: DeviceState, job: Job) -> Reply:
    context = state.set_device(state.session(job.session))
    return Reply({"context": state.record(context).to_wire()})


@device_handler(ops.CurrentContext)
def current_context(state: DeviceState, job: Job) -> Reply:
    context = state.current(state.session(job.session))
    return Reply({"context": None if context is None else state.record(context).to_wire()})


@device_handler(ops.ContextStack)
def context_stack(state: DeviceState, job: Job) -> Reply:
    stack = state.session(job.session).stack
    return Reply({"stack": [state.record(c).to_wire() for c in stack]})


@device_handler(ops.CreateContext)
def create_context(state: DeviceState, job: Job) -> Reply:
    context = state.create(state.session(job.session), job.args.flags)
    return Reply({"context": state.record(context).to_wire()})


@device_handler(ops.PushContext)
def push_context(state: DeviceState, job: Job) -> Reply:
    session = state.session(job.session)
    context = state.context(session, job.args.context)
    session.stack.append(context)
    return Reply({"context": state.record(context).to_wire()})


@device_handler(ops.PopContext)
def pop_context(state: DeviceState, job: Job) -> Reply:
    session = state.session(job.session)
    if not session.stack:
        raise CudaError.of(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"the context stack on device {job.device} is empty")
    context = session.stack.pop()
    return Reply({"context": state.record(context).to_wire()})


@device_handler(ops.DestroyContext)
def destroy_context(state: DeviceState, job: Job) -> Reply:
    state.destroy(state.session(job.session), job.args.context)
    return Reply()


@device_handler(ops.ContextInfo)
def context_info(state: DeviceState, job: Job) -> Reply:
    context = state.context(state.session(job.session), job.args.context)
    state.activate(context)
    record = state.record(context).to_wire()
    record["flags"] = state.driver.ctx_get_flags()
    record["device"] = state.driver.ctx_get_device()
    return Reply({"context": record})


@device_handler(ops.Synchronize)
def synchronize(state: DeviceState, job: Job) -> Pending:
    markers = state.context_markers([state.current_or_primary(state.session(job.session))])
    return _when_done(state, markers, {})


@device_handler(ops.DeviceSynchronize)
def device_synchronize(state: DeviceState, job: Job) -> Pending:
    contexts = state.live_contexts()
    return _when_done(state, state.context_markers(contexts), {"contexts": len(contexts)})


def _when_done(state: DeviceState, markers: list[Marker], result: dict[str, int]) -> Pending:
    def then() -> Reply:
        state.recycle_markers(markers)
        return Reply(result)

    return Pending(lambda: state.markers_done(markers), then)
