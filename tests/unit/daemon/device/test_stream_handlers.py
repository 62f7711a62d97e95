"""The stream and event handlers (daemon/handlers/stream_ops.py) against a plain DeviceState on the sim, run as
the worker runs them: what tests/integration/test_streams.py checks through a daemon, without one (that file
keeps the client's API and both routes to a device)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cuctxd.daemon.device.state import DeviceState
from cuctxd.protos.errors import CudaError, UnknownHandle
from tests.unit.daemon.device.test_data_plane_state import make_state
from tests.unit.daemon.device.test_device_state import new_ref, run

MIB = 1 << 20


@pytest.fixture
def state() -> Iterator[DeviceState]:
    state = make_state(memory=64 * MIB, primary_keep=0.0)  # the primary goes with its last user
    yield state
    state.tickets.close()


def test_work_on_one_stream_runs_in_order_and_a_destroyed_stream_is_an_unknown_handle(state: DeviceState) -> None:
    ref = new_ref()
    stream = run(state, ref, "create_stream").result
    assert stream["device"] == 0 and stream["context"] is not None
    handle = stream["stream"]
    src = run(state, ref, "alloc", size=MIB).result["buffer"]["handle"]
    dst = run(state, ref, "alloc", size=MIB).result["buffer"]["handle"]
    payload = bytes(range(256)) * 4096
    run(state, ref, "write", (payload,), buffer=src, stream=handle)
    run(state, ref, "copy", src=src, dst=dst, stream=handle)
    run(state, ref, "fill", buffer=dst, value=9, size=16, stream=handle)
    assert bytes(run(state, ref, "read", buffer=dst, size=32, stream=handle).frames[0]) == b"\x09" * 16 + payload[16:32]
    assert run(state, ref, "stream_synchronize", stream=handle).result == {}
    assert run(state, ref, "stream_query", stream=handle).result == {"done": True}
    run(state, ref, "destroy_stream", stream=handle)
    with pytest.raises(UnknownHandle):
        run(state, ref, "stream_query", stream=handle)


def test_events_order_two_streams_and_time_work(state: DeviceState) -> None:
    ref = new_ref()
    first = run(state, ref, "create_stream").result["stream"]
    second = run(state, ref, "create_stream", non_blocking=True).result["stream"]
    start, end = (run(state, ref, "create_event").result["event"] for _ in range(2))
    buf = run(state, ref, "alloc", size=8 * MIB).result["buffer"]["handle"]
    run(state, ref, "record_event", event=start, stream=first)
    run(state, ref, "fill", buffer=buf, value=5, stream=first)
    run(state, ref, "record_event", event=end, stream=first)
    run(state, ref, "stream_wait_event", stream=second, event=end)
    read = run(state, ref, "read", buffer=buf, size=4, offset=8 * MIB - 4, stream=second)
    assert bytes(read.frames[0]) == b"\x05" * 4
    assert run(state, ref, "event_synchronize", event=end).result == {}
    assert run(state, ref, "event_query", event=end).result == {"done": True}
    assert run(state, ref, "event_elapsed_time", start=start, end=end).result["ms"] >= 0.0
    untimed = run(state, ref, "create_event", timing=False).result["event"]
    run(state, ref, "record_event", event=untimed)  # on the legacy default stream
    run(state, ref, "event_synchronize", event=untimed)
    with pytest.raises(CudaError) as no_timing:
        run(state, ref, "event_elapsed_time", start=start, end=untimed)
    assert no_timing.value.name == "CUDA_ERROR_INVALID_HANDLE"
    for event in (start, end, untimed):
        run(state, ref, "destroy_event", event=event)
    with pytest.raises(UnknownHandle):
        run(state, ref, "event_query", event=end)


def test_streams_and_events_are_scoped_to_their_session(state: DeviceState) -> None:
    ref, other = new_ref(), new_ref()
    stream = run(state, ref, "create_stream").result["stream"]
    event = run(state, ref, "create_event").result["event"]
    for op, args in (("stream_query", {"stream": stream}), ("destroy_stream", {"stream": stream}),
                     ("event_query", {"event": event}), ("record_event", {"event": event}),
                     ("stream_wait_event", {"stream": stream, "event": event})):
        with pytest.raises(UnknownHandle):
            run(state, other, op, **args)
    assert run(state, ref, "stream_query", stream=stream).result == {"done": True}, "the owner's are untouched"


def test_closing_the_session_destroys_its_streams_and_events(state: DeviceState) -> None:
    ref = new_ref()
    run(state, ref, "create_stream")
    run(state, ref, "create_event")
    session = state.sessions[ref.token]
    assert len(session.streams) == 1 and len(session.events) == 1
    state.close_session(ref)
    assert ref.token not in state.sessions
    assert state.driver.primary_ctx_state(0)[1] is False, "the primary, with its stream and event, is gone"
