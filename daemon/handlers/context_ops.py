"""Context ops, run on the device's worker thread: the runtime's set_device and the driver's cuCtx*."""

from __future__ import annotations

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.registry import device_handler
from cuctxd.daemon.handlers.replies import Pending, Reply, after_markers
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos import ops
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.limits import MAX_LISTED


@device_handler(ops.SetDevice)
def set_device(state: DeviceState, job: Job[ops.SetDevice]) -> Reply:
    context = state.contexts.set_device(state.session(job.session))
    return Reply({"context": state.contexts.record(context).to_wire()})


@device_handler(ops.CurrentContext)
def current_context(state: DeviceState, job: Job[ops.CurrentContext]) -> Reply:
    context = state.contexts.top(state.session(job.session))
    return Reply({"context": None if context is None else state.contexts.record(context).to_wire()})


@device_handler(ops.ContextStack)
def context_stack(state: DeviceState, job: Job[ops.ContextStack]) -> Reply:
    stack = state.session(job.session).stack
    shown = stack[-MAX_LISTED:]  # the top of the stack: the current context and those pushed last
    return Reply({"stack": [state.contexts.record(c).to_wire() for c in shown], "depth": len(stack),
                  "truncated": len(shown) < len(stack)})


@device_handler(ops.CreateContext)
def create_context(state: DeviceState, job: Job[ops.CreateContext]) -> Reply:
    context = state.contexts.create(state.session(job.session), job.args.flags)
    return Reply({"context": state.contexts.record(context).to_wire()})


@device_handler(ops.PushContext)
def push_context(state: DeviceState, job: Job[ops.PushContext]) -> Reply:
    session = state.session(job.session)
    context = session.contexts[job.args.context]
    session.stack.append(context)
    return Reply({"context": state.contexts.record(context).to_wire()})


@device_handler(ops.PopContext)
def pop_context(state: DeviceState, job: Job[ops.PopContext]) -> Reply:
    session = state.session(job.session)
    if not session.stack:
        raise CudaError.of(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"the context stack on device {job.device} is empty")
    context = session.stack.pop()
    return Reply({"context": state.contexts.record(context).to_wire()})


@device_handler(ops.DestroyContext)
def destroy_context(state: DeviceState, job: Job[ops.DestroyContext]) -> Reply:
    state.destroy_context(state.session(job.session), job.args.context)
    return Reply()


@device_handler(ops.ContextInfo)
def context_info(state: DeviceState, job: Job[ops.ContextInfo]) -> Reply:
    context = state.session(job.session).contexts[job.args.context]
    state.activate(context)
    record = state.contexts.record(context).to_wire()
    record["flags"] = state.driver.ctx_get_flags()
    record["device"] = state.driver.ctx_get_device()
    return Reply({"context": record})


@device_handler(ops.Synchronize)
def synchronize(state: DeviceState, job: Job[ops.Synchronize]) -> Pending:
    session = state.session(job.session)
    session.raise_deferred()
    context = state.contexts.current_or_primary(session)
    return after_markers(state.streams, state.streams.context_markers([context]), Reply())


@device_handler(ops.DeviceSynchronize)
def device_synchronize(state: DeviceState, job: Job[ops.DeviceSynchronize]) -> Pending:
    state.session(job.session).raise_deferred()
    contexts = state.live_contexts()
    return after_markers(state.streams, state.streams.context_markers(contexts), Reply({"contexts": len(contexts)}))
