"""A call in flight when the daemon dies (issue 41, item 7), on every transport and in both client flavours.

The daemon is frozen (SIGSTOP) so that the call stays unanswered, the call is sent, and the daemon is then
SIGKILLed and, as a service manager would, started again on the same endpoint at once
(:class:`~tests.reliability.restarts.QuickRestart`: plainly, or under the test service manager), or left dead.
No reply can come, from the dead daemon or its replacement. The call must fail by name, ``SessionLost``
caused by ``NoDaemon`` (``DaemonRestarted`` where another daemon listens), within :data:`AT_ONCE_S` of the
kill, far below the client's :data:`TIMEOUT`: on the main socket over ipc:// (where the new socket file
may get the old one's inode, so only the daemon's identity tells them apart), over tcp:// (where the
client asks ``ping`` for the daemon's ``instance``), on a device endpoint's socket and on an shm lane.
After a restart the client's ``reconnect()`` opens a session with the new instance.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cuctxd.client import AsyncClient, Client, NoDaemon, SessionLost
from tests.helpers import freeze
from tests.reliability.restarts import RESTARTS, TIMEOUT, Scene, in_flight_on

SIM = ("--sim-devices", "1", "--sim-memory", "64MiB")
#: What the failing call may take past the kill: one liveness probe (1 s; a ``ping`` over tcp:// waits
#: up to 0.5 s more) and a loaded 2-core machine's slack, well below :data:`TIMEOUT`.
AT_ONCE_S = 3.0
#: (flavour, transport): where the call in flight waits. The async client has no shm lanes.
CASES = [("sync", "ipc"), ("sync", "tcp"), ("sync", "device"), ("sync", "shm"),
         ("async", "ipc"), ("async", "tcp"), ("async", "device")]

#: A read on a stream this large fits no shm lane's area and takes no staging ring: the device's socket.
LARGE = 96 << 10

pytestmark = pytest.mark.timeout(90)

Outcome = tuple[BaseException | None, float]


def _failed_by_name(outcome: Outcome, killed: float, op: str) -> None:
    error, ended = outcome
    assert isinstance(error, SessionLost), f"the call in flight ended with {error!r}"
    assert error.name == "CUCTXD_SESSION_LOST" and error.op == op, (error.name, error.op)
    assert isinstance(error.__cause__, NoDaemon), repr(error.__cause__)
    assert ended - killed < AT_ONCE_S, f"the call in flight failed {ended - killed:.2f} s after the kill"


def _sync_call(client: Client, transport: str) -> tuple[Callable[[], Any], str, str]:
    """The call to leave in flight, its op, and where it waits (the session made ready for it first)."""
    if transport in ("ipc", "tcp"):
        return client.status, "status", "main"
    if transport == "shm":
        buffer = client.alloc(64)
        buffer.read(8)  # opens the lane
        assert client.shm_lanes == (0,)
        return lambda: buffer.read(8), "read", "shm"
    buffer, stream = client.alloc(LARGE), client.create_stream(0)
    return lambda: buffer.read(LARGE, stream=stream), "read", "device"  # too large for a lane, no ring


def _run_sync(scene: Scene, transport: str, restart: str) -> None:
    with Client(scene.endpoint, timeout=TIMEOUT, name="in-flight", device_endpoints=transport in ("device", "shm"),
                ) as client:
        call, op, where = _sync_call(client, transport)
        freeze(scene.daemon.process.pid)
        outcomes: list[Outcome] = []

        def wait_for_reply() -> None:
            try:
                call()
            except BaseException as exc:
                outcomes.append((exc, time.monotonic()))
            else:
                outcomes.append((None, time.monotonic()))

        waiter = threading.Thread(target=wait_for_reply, name="call-in-flight")
        waiter.start()
        deadline = time.monotonic() + 10
        while where not in in_flight_on(client):
            assert time.monotonic() < deadline, "the call was never sent"
            time.sleep(0.002)
        killed = scene.kill_and_restart()
        waiter.join(TIMEOUT + 5)
        assert not waiter.is_alive() and len(outcomes) == 1, "the call in flight outlived the client's timeout"
        _failed_by_name(outcomes[0], killed, op)
        if restart != "none":
            before = client.instance
            client.reconnect()
            assert client.restarted and client.instance != before
            client.ping()


async def _async_call(client: AsyncClient, transport: str) -> tuple[Callable[[], Awaitable[Any]], str, str]:
    if transport in ("ipc", "tcp"):
        return client.status, "status", "main"
    buffer = await client.alloc(64)
    await buffer.read(8)
    return lambda: buffer.read(8), "read", "device"


async def _run_async(scene: Scene, transport: str, restart: str) -> None:
    async with AsyncClient(scene.endpoint, timeout=TIMEOUT, name="in-flight",
                           device_endpoints=transport == "device") as client:
        call, op, where = await _async_call(client, transport)
        freeze(scene.daemon.process.pid)

        async def wait_for_reply() -> Outcome:
            try:
                await call()
            except BaseException as exc:
                return exc, time.monotonic()
            return None, time.monotonic()

        waiter = asyncio.create_task(wait_for_reply())
        deadline = time.monotonic() + 10
        while where not in in_flight_on(client):
            assert time.monotonic() < deadline, "the call was never sent"
            await asyncio.sleep(0.002)
        killed = await asyncio.to_thread(scene.kill_and_restart)
        outcome = await asyncio.wait_for(waiter, TIMEOUT + 5)
        _failed_by_name(outcome, killed, op)
        if restart != "none":
            before = client.instance
            await client.reconnect()
            assert client.restarted and client.instance != before
            await client.ping()


@pytest.mark.parametrize("restart", RESTARTS)
@pytest.mark.parametrize(("flavour", "transport"), CASES)
def test_a_call_in_flight_when_the_daemon_dies_fails_by_name_within_a_probe(workdir: Path, flavour: str,
                                                                             transport: str, restart: str) -> None:
    scene = Scene(workdir, transport, restart, SIM)
    try:
        if flavour == "sync":
            _run_sync(scene, transport, restart)
        else:
            asyncio.run(_run_async(scene, transport, restart))
    finally:
        code = scene.close()
    assert code in (0, None), scene.replacement.log() if scene.replacement is not None else code
