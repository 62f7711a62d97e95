"""Stream and event ops, run on the device's worker thread; synchronizations reply when done."""

from __future__ import annotations

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.registry import device_handler
from cuctxd.daemon.handlers.replies import Pending, Reply, after_markers
from cuctxd.daemon.intake.jobs import Job
from cuctxd.protos import stream_ops as ops


@device_handler(ops.CreateStream)
def create_stream(state: DeviceState, job: Job[ops.CreateStream]) -> Reply:
    session = state.session(job.session)
    entry = state.streams.create_stream(session, state.contexts.for_new(session, "stream"), job.args.non_blocking)
    return Reply({"stream": entry.handle, "context": entry.context.handle, "device": state.device})


@device_handler(ops.DestroyStream)
def destroy_stream(state: DeviceState, job: Job[ops.DestroyStream]) -> Reply:
    state.streams.destroy_stream(state.session(job.session), job.args.stream)
    return Reply()


@device_handler(ops.StreamQuery)
def stream_query(state: DeviceState, job: Job[ops.StreamQuery]) -> Reply:
    stream = state.streams.stream_of(state.session(job.session), job.args.stream)
    assert stream is not None
    return Reply({"done": state.driver.stream_query(stream)})


@device_handler(ops.StreamSynchronize)
def stream_synchronize(state: DeviceState, job: Job[ops.StreamSynchronize]) -> Pending:
    session = state.session(job.session)
    session.raise_deferred()
    entry = session.streams[job.args.stream]
    return after_markers(state.streams, [state.streams.marker_on(entry.context, entry.stream)], Reply())


@device_handler(ops.CreateEvent)
def create_event(state: DeviceState, job: Job[ops.CreateEvent]) -> Reply:
    session = state.session(job.session)
    entry = state.streams.create_event(session, state.contexts.for_new(session, "event"), job.args.timing)
    return Reply({"event": entry.handle, "context": entry.context.handle, "device": state.device})


@device_handler(ops.DestroyEvent)
def destroy_event(state: DeviceState, job: Job[ops.DestroyEvent]) -> Reply:
    state.streams.destroy_event(state.session(job.session), job.args.event)
    return Reply()


@device_handler(ops.RecordEvent)
def record_event(state: DeviceState, job: Job[ops.RecordEvent]) -> Reply:
    session = state.session(job.session)
    event = session.events[job.args.event]
    stream = state.streams.stream_of(session, job.args.stream)
    if stream is None:
        state.activate(event.context)
    state.driver.event_record(event.event, stream)
    return Reply()


@device_handler(ops.EventQuery)
def event_query(state: DeviceState, job: Job[ops.EventQuery]) -> Reply:
    event = state.session(job.session).events[job.args.event]
    state.activate(event.context)
    return Reply({"done": state.driver.event_query(event.event)})


@device_handler(ops.EventSynchronize)
def event_synchronize(state: DeviceState, job: Job[ops.EventSynchronize]) -> Pending:
    event = state.session(job.session).events[job.args.event]

    def done() -> bool:
        state.activate(event.context)
        return state.driver.event_query(event.event)

    return Pending(done, Reply)


@device_handler(ops.EventElapsedTime)
def event_elapsed_time(state: DeviceState, job: Job[ops.EventElapsedTime]) -> Reply:
    session = state.session(job.session)
    start, end = session.events[job.args.start], session.events[job.args.end]
    return Reply({"ms": state.streams.elapsed_ms(start, end)})


@device_handler(ops.StreamWaitEvent)
def stream_wait_event(state: DeviceState, job: Job[ops.StreamWaitEvent]) -> Reply:
    session = state.session(job.session)
    event = session.events[job.args.event]
    stream = state.streams.stream_of(session, job.args.stream)
    assert stream is not None
    state.driver.stream_wait_event(stream, event.event)
    return Reply()
