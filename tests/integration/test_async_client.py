"""The asyncio client against a real daemon: the sync client's API as coroutines.

Each test runs its own event loop with ``asyncio.run``; no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from cuctxd.client import (
    AsyncBuffer,
    AsyncClient,
    AsyncContext,
    AsyncEvent,
    AsyncOpenedShare,
    AsyncPipeline,
    AsyncStream,
    Buffer,
    Client,
    ConnectionLost,
    Context,
    CudaError,
    DaemonTimeout,
    Event,
    NotShareable,
    OpenedShare,
    OutOfRange,
    Pipeline,
    SessionExpired,
    Stream,
    TooLarge,
    UnknownHandle,
    WrongBackend,
)
from cuctxd.client.wire import build
from cuctxd.client.wire.lease import AsyncHeartbeat
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import (
    DaemonProcess,
    freeze,
    pattern,
    remove_tempdir,
    session_ids,
    start_daemon,
    wait_until,
)

T = TypeVar("T")
MiB = 1 << 20
LEASE_TTL = 1.0


def run(daemon: DaemonProcess, body: Callable[[AsyncClient], Awaitable[T]], **options: Any) -> T:
    """Run ``body`` with a fresh, open session in a new event loop."""

    async def main() -> T:
        async with AsyncClient(daemon.endpoint, **{"timeout": 10, **options}) as client:
            return await body(client)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def short_lease() -> Iterator[DaemonProcess]:
    """A daemon with a 1 s lease and 1 MiB payload frames."""
    process = start_daemon("--sim-devices", "1", "--lease-ttl", str(LEASE_TTL), "--max-payload", "1MiB")
    yield process
    assert process.stop() == 0, process.log()
    remove_tempdir(process.socket_dir)


# --- the same API -------------------------------------------------------------------------

TWINS = [(Client, AsyncClient), (Buffer, AsyncBuffer), (Context, AsyncContext), (Stream, AsyncStream),
         (Event, AsyncEvent), (OpenedShare, AsyncOpenedShare), (Pipeline, AsyncPipeline)]
#: Async methods that return at once: a pipeline, and a pipeline's task.
NOT_COROUTINES = {(AsyncClient, "pipeline"), (AsyncPipeline, "send")}


def shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(("sync", "twin"), TWINS, ids=[s.__name__ for s, _ in TWINS])
def test_every_sync_method_has_an_async_twin_with_the_same_arguments(sync: type, twin: type) -> None:
    methods = [name for name, _ in inspect.getmembers(sync, inspect.isfunction) if not name.startswith("_")]
    assert methods
    for name in methods:
        mine, theirs = getattr(twin, name), getattr(sync, name)
        if mine is theirs:
            continue  # one method shared by both flavours: local work, or a pipeline op returning a future
        assert shape(mine) == shape(theirs), name
        if (twin, name) not in NOT_COROUTINES:
            assert inspect.iscoroutinefunction(mine), f"{twin.__name__}.{name} must be awaitable"
    if hasattr(sync, "__enter__"):
        assert inspect.iscoroutinefunction(twin.__aenter__) and inspect.iscoroutinefunction(twin.__aexit__)


def test_async_methods_carry_the_sync_docs() -> None:
    assert AsyncClient.alloc.__doc__ == Client.alloc.__doc__
    assert AsyncBuffer.write.__doc__ == Buffer.write.__doc__
    assert AsyncStream.query.__doc__ == Stream.query.__doc__


# --- session ---------------------------------------------------------------------------------


def test_the_seed_program(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        assert await c.current_context() is None  # a new session has no context
        assert await c.device_count() == 2  # cudaGetDeviceCount creates none
        assert await c.current_context() is None
        assert await c.context_stack() == []
        status = await c.status()
        assert [d["primary_context"]["active"] for d in status["devices"]] == [False, False]
        context = await c.set_device(0)  # binds the primary and makes it current
        assert isinstance(context, AsyncContext)
        assert context.is_primary and context.device == 0
        current = await c.current_context()
        assert current is not None and current.handle == context.handle
        status = await c.status()
        assert [d["primary_context"]["active"] for d in status["devices"]] == [True, False]
        assert await c.get_device() == 0

    run(daemon, body)


def test_hello_and_daemon_calls(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        assert c.protocol == PROTOCOL_VERSION
        assert c.backend == "sim"
        assert c.session_id >= 1
        assert c.limits["max_payload_bytes"] == 1 << 30
        assert 0 < await c.ping() < 5
        assert [d.index for d in await c.devices()] == [0, 1]
        status = await c.status()
        mine = [s for s in status["sessions"] if s["session"] == c.session_id]
        assert mine[0]["client"] == "async-test"
        assert mine[0]["pid"] == os.getpid()

    run(daemon, body, name="async-test")


def test_awaiting_the_constructor_opens_and_close_ends_the_session(daemon: DaemonProcess) -> None:
    async def main() -> None:
        with Client(daemon.endpoint, timeout=10) as observer:
            c = await AsyncClient(daemon.endpoint, timeout=10)
            assert c.session_id in {s["session"] for s in observer.status()["sessions"]}
            await c.close()
            assert c.session_id not in {s["session"] for s in observer.status()["sessions"]}
            with pytest.raises(ConnectionLost):
                await c.ping()
            await c.close()  # a second close is harmless

    asyncio.run(main())


def test_calls_before_opening_say_so() -> None:
    async def main() -> None:
        c = AsyncClient("ipc:///nonexistent/cuctxd.sock")
        with pytest.raises(ConnectionLost, match="not open"):
            await c.ping()
        await c.close()

    asyncio.run(main())


# --- contexts --------------------------------------------------------------------------------


def test_context_ops(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        primary = await c.set_device(0)
        created = await c.create_context()
        assert not created.is_primary and created.context_id != primary.context_id
        assert [x.handle for x in await c.context_stack()] == [primary.handle, created.handle]
        assert (await c.pop_context()).handle == created.handle
        await created.push()
        await c.push_context(created)
        assert [x.handle for x in await c.context_stack()] == [primary.handle, created.handle, created.handle]
        info = await created.info()
        assert (info.handle, info.device, info.is_primary) == (created.handle, 0, False)
        assert (await c.context_info(primary)).is_primary
        await created.destroy()
        assert [x.handle for x in await c.context_stack()] == [primary.handle]
        await c.synchronize()

        assert await c.current_context(device=1) is None
        on1 = await c.create_context(device=1, flags=0x04)
        assert (await on1.info()).flags == 0x04
        current = await c.current_context(device=1)
        assert current is not None and current.handle == on1.handle
        await c.destroy_context(on1)
        await c.device_synchronize(device=1)
        await c.synchronize(device=1)  # binds device 1's primary lazily
        current = await c.current_context(device=1)
        assert current is not None and current.is_primary

    run(daemon, body)


# --- memory ----------------------------------------------------------------------------------


def test_memory_ops(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        free0, total = await c.mem_get_info()
        assert total == 64 * MiB
        assert (await c.memory_info())["total"] == total
        big = await c.alloc(4 * MiB)
        assert (await c.mem_get_info())[0] == free0 - 4 * MiB
        await big.free()
        assert big.freed

        buffer = await c.alloc(10_000)
        assert isinstance(buffer, AsyncBuffer)
        assert (buffer.size, buffer.device) == (10_000, 0)
        data = pattern(10_000)
        assert await buffer.write(data) == 10_000
        assert await buffer.read() == data
        assert await c.write(buffer, b"XYZ", offset=9_997) == 3
        assert await buffer.read(10, offset=9_990) == data[9_990:9_997] + b"XYZ"
        assert await c.read(buffer, 0, offset=10_000) == b""
        out = bytearray(1000)
        assert await buffer.read_into(out, offset=96) == 1000
        assert bytes(out) == data[96:1096]
        assert await c.read_into(buffer, out) == 1000

        await buffer.fill(0x11)
        await c.fill(buffer, 0xFF, offset=100, size=50)
        assert await buffer.read(200) == b"\x11" * 100 + b"\xff" * 50 + b"\x11" * 50

        other = await c.alloc(10_000, device=1)
        await buffer.write(data)
        assert await buffer.copy_to(other, 1000, src_offset=500, dst_offset=3000) == 1000
        assert await other.read(1000, offset=3000) == data[500:1500]
        assert await c.copy(other, buffer, 10) == 10
        assert await buffer.read(10) == bytes(10)

        async with await c.alloc(4096) as scoped:
            await scoped.fill(1)
        assert scoped.freed
        await c.free(other)

    run(daemon, body)


def test_large_writes_and_reads_are_chunked(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        size = 12 * MiB + 123
        payload = os.urandom(size)
        buffer = await c.alloc(size, device=1)
        assert await buffer.write(memoryview(payload)) == size
        assert await buffer.read() == payload
        out = bytearray(size)
        assert await buffer.read_into(out) == size
        assert out == payload

    run(daemon, body)


# --- streams, events, pipelining ---------------------------------------------------------------


def test_streams_and_events(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        first = await c.create_stream(0)
        second = await c.create_stream(non_blocking=True)
        assert isinstance(first, AsyncStream) and second.device == 0
        start, end = await c.create_event(0), await c.create_event()
        assert isinstance(start, AsyncEvent)
        src, dst = await c.alloc(MiB, 0), await c.alloc(MiB, 0)
        payload = bytes(range(256)) * 4096
        await start.record(first)
        assert await src.write(payload, stream=first) == MiB
        await src.copy_to(dst, stream=first)
        await dst.fill(9, size=16, stream=first)
        await end.record(first)
        await second.wait_event(end)
        assert await dst.read(32, stream=second) == b"\x09" * 16 + payload[16:32]
        await end.synchronize()
        assert await end.query() is True
        assert await start.elapsed_time(end) >= 0.0
        await first.synchronize()
        assert await first.query() is True

        untimed = await c.create_event(0, timing=False)
        await untimed.record()
        await untimed.synchronize()
        with pytest.raises(CudaError) as no_timing:
            await start.elapsed_time(untimed)
        assert no_timing.value.name == "CUDA_ERROR_INVALID_HANDLE"
        for obj in (start, end, untimed, first, second):
            await obj.destroy()
        with pytest.raises(UnknownHandle):
            await first.query()

    run(daemon, body)


def test_pipelined_writes_land_in_order(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        buffer = await c.alloc(64 * 300, 0)
        async with c.pipeline() as p:
            writes = [p.write(buffer, bytes([i % 256]) * 64, offset=i * 64) for i in range(300)]
            last = p.read(buffer, 64, offset=299 * 64)
        assert all(w.result() == 64 for w in writes)
        assert last.result() == bytes([299 % 256]) * 64
        data = await buffer.read()
        assert all(data[i * 64] == i % 256 for i in range(300))

        with pytest.raises(OutOfRange):
            async with c.pipeline() as p:
                p.write(buffer, b"x" * 64, offset=0)
                p.write(buffer, b"y" * 64, offset=10**6)
        assert await buffer.read(1) == b"x"

    run(daemon, body)


# --- many tasks, one client ----------------------------------------------------------------------


def test_fifty_tasks_share_one_client(daemon: DaemonProcess) -> None:
    async def task(c: AsyncClient, n: int) -> int:
        size = 9 * MiB if n % 10 == 0 else 4096 + 997 * n  # some chunked, most one frame
        data = pattern(size, seed=n) if size < MiB else os.urandom(size)
        buffer = await c.alloc(size, device=n % 2)
        assert await buffer.write(data) == size
        await asyncio.sleep(0)
        assert await buffer.read() == data
        out = bytearray(size // 2)
        assert await buffer.read_into(out, offset=size // 4) == size // 2
        assert out == data[size // 4:size // 4 + size // 2]
        await buffer.free()
        return buffer.handle

    async def body(c: AsyncClient) -> None:
        handles = await asyncio.gather(*(task(c, n) for n in range(50)))
        assert len(set(handles)) == 50
        entries = [s for d in (await c.status())["devices"] for s in d["sessions"] if s["session"] == c.session_id]
        assert sum(e["allocations"] for e in entries) == 0  # everything freed, in this one session

    run(daemon, body)


def test_an_error_in_one_task_reaches_only_that_task(daemon: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        buffer = await c.alloc(128)
        outcomes = await asyncio.gather(buffer.write(b"a" * 64), buffer.write(b"b" * 64, offset=100),
                                        c.alloc(0), buffer.read(64), return_exceptions=True)
        assert outcomes[0] == 64
        assert isinstance(outcomes[1], OutOfRange)
        assert isinstance(outcomes[2], CudaError) and outcomes[2].name == "CUDA_ERROR_INVALID_VALUE"
        assert outcomes[3] == b"a" * 64

    run(daemon, body)


# --- timeouts and errors -------------------------------------------------------------------------


def test_a_call_to_a_stopped_daemon_times_out_and_its_late_reply_is_dropped(short_lease: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        buffer = await c.alloc(64)
        await buffer.fill(7)
        freeze(short_lease.process.pid)
        try:
            start = time.monotonic()
            with pytest.raises(DaemonTimeout):
                await buffer.read(4)
            assert time.monotonic() - start < 0.5 + 1.0
        finally:
            os.kill(short_lease.process.pid, signal.SIGCONT)
        assert await c.get_device() == 0  # not the late read's reply
        assert await buffer.read(4) == b"\x07" * 4

    run(short_lease, body, timeout=0.5)


def test_errors_are_typed_like_the_sync_clients(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, timeout=10) as sync, pytest.raises(CudaError) as sync_error:
        sync.alloc(0)

    async def body(c: AsyncClient) -> None:
        with pytest.raises(CudaError) as empty:
            await c.pop_context()  # a new session's stack is empty
        assert empty.value.name == "CUDA_ERROR_INVALID_CONTEXT"
        with pytest.raises(CudaError) as info:
            await c.alloc(0)
        assert type(info.value) is type(sync_error.value)
        assert (info.value.name, info.value.code, info.value.op) == ("CUDA_ERROR_INVALID_VALUE", 1, "alloc")
        buffer = await c.alloc(64)
        await buffer.free()
        with pytest.raises(UnknownHandle) as gone:
            await buffer.read()
        assert gone.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"
        with pytest.raises(OutOfRange):
            await (await c.alloc(16)).write(b"x" * 17)

    run(daemon, body)


def test_a_frame_over_the_payload_limit_is_refused_before_sending(short_lease: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        assert c.limits["max_payload_bytes"] == MiB
        buffer = await c.alloc(2 * MiB)
        with pytest.raises(TooLarge) as refused:  # the socket path: one payload frame
            await c.run(build.write(buffer, bytes(2 * MiB), 0, None, c.limits["max_payload_bytes"]))
        assert refused.value.op == "write"
        assert await buffer.write(bytes(MiB)) == MiB
        assert await buffer.write(bytes(2 * MiB)) == 2 * MiB  # the staging ring sends no frame

    run(short_lease, body)


# --- sharing -----------------------------------------------------------------------------------


def test_open_shared_maps_a_published_buffer(daemon: DaemonProcess) -> None:
    data = bytes(range(256)) * 16

    async def holders(c: AsyncClient) -> list[list[int]]:
        return [s["holders"] for s in (await c.status())["devices"][1]["shares"]]

    async def body(owner: AsyncClient) -> None:
        source = await owner.alloc(4096, device=1, shareable=True)
        await source.write(data)
        published = await source.publish("async-weights")
        assert (await owner.lookup("async-weights")).share_id == published.share_id
        async with AsyncClient(daemon.endpoint, timeout=10) as holder:
            shared = await holder.open_shared("async-weights")
            assert isinstance(shared, AsyncOpenedShare)
            assert (shared.device, shared.size, shared.backend) == (1, 4096, "sim")
            assert bytes(shared.host_view()) == data
            with pytest.raises(WrongBackend):
                _ = shared.ptr
            shared.host_view()[:3] = b"abc"
            assert await source.read(3) == b"abc"
            assert await holders(owner) == [[holder.session_id]]
            await shared.close()
            assert shared.closed
            await shared.close()  # nothing the second time
            assert await holders(owner) == [[]]

            async with await holder.open_shared(await source.export()) as again:
                assert bytes(again.host_view()[:3]) == b"abc"
            assert again.closed
            elsewhere = dataclasses.replace(published, host="elsewhere")
            with pytest.raises(NotShareable):
                await holder.open_shared(elsewhere)
            assert await holders(owner) == [[]]
        assert [s["name"] for s in await owner.list_shared(prefix="async-", owner=owner.session_id)] == [
            "async-weights"]
        page = await owner.shared_page(limit=1, prefix="async")
        assert [s["name"] for s in page.shared] == ["async-weights"] and page.next is None and page.count == 1
        await owner.unpublish("async-weights")
        assert await owner.list_shared() == []

    run(daemon, body)


def test_open_shared_maps_a_vmm_buffer_through_its_fd(daemon: DaemonProcess) -> None:
    """A shareable buffer above POOL_BUFFER_MAX (32 MiB) is VMM memory: the async client asks for its fd too."""
    size = 40 * MiB

    async def body(owner: AsyncClient) -> None:
        source = await owner.alloc(size, device=0, shareable=True)
        await source.write(b"the end", offset=size - 7)
        exported = await source.export()  # not published: 64 MiB devices leave no room for 40 MiB orphans
        assert exported.mechanism == "vmm" and exported.allocation_size == size
        async with AsyncClient(daemon.endpoint, timeout=10) as holder, await holder.open_shared(exported) as shared:
            assert bytes(shared.host_view()[-7:]) == b"the end" and len(shared.host_view()) == size
            shared.host_view()[:3] = b"abc"
            assert await source.read(3) == b"abc"
        await source.free()

    run(daemon, body)


# --- leases --------------------------------------------------------------------------------------


def reaped(daemon: DaemonProcess, session_id: int) -> bool:
    """Whether the session ``session_id`` is reaped within the lease and a margin (a blocking wait: run it off the
    event loop, whose heartbeat task must go on)."""
    with Client(daemon.endpoint) as observer:
        return wait_until(lambda: session_id not in session_ids(observer), LEASE_TTL + 3.0)


def test_heartbeats_keep_an_idle_session_alive(short_lease: DaemonProcess) -> None:
    """Idle on purpose until a session started with it but without heartbeats has been reaped: the lease ran
    out for both, and the heartbeat task covered the idle one."""
    async def body(c: AsyncClient) -> None:
        buffer = await c.alloc(1024)
        await buffer.fill(3)
        with Client(short_lease.endpoint, heartbeat=False) as quiet:
            quiet.alloc(1024)
            assert await asyncio.to_thread(reaped, short_lease, quiet.session_id)
        assert await buffer.read(2) == b"\x03\x03"

    run(short_lease, body)


def test_without_heartbeats_an_idle_session_expires(short_lease: DaemonProcess) -> None:
    async def body(c: AsyncClient) -> None:
        await c.alloc(1024)
        assert await asyncio.to_thread(reaped, short_lease, c.session_id)  # silent past the lease, until reaped
        with pytest.raises(SessionExpired):
            await c.alloc(1024)

    run(short_lease, body, heartbeat=False)


def test_the_heartbeat_stops_once_the_session_is_gone(short_lease: DaemonProcess) -> None:
    async def main() -> None:
        beat = AsyncHeartbeat(short_lease.endpoint, "not-a-session", lease_ttl=0.15)
        try:
            deadline = time.monotonic() + 5
            while not beat.expired and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert beat.expired
        finally:
            await beat.stop()

    asyncio.run(main())
