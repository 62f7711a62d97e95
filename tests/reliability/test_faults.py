"""Faults: clients SIGKILLed mid-transfer, the daemon SIGKILLed and restarted, a session quota run full.

* A client process killed while it moves megabytes leaves a daemon that goes
  on answering, reaps the session within its lease (``--lease-ttl 1.5``) plus
  the reaper's period and a margin, and gets all the memory back.
* A daemon killed with SIGKILL and started again on the same ipc:// endpoint:
  a client that had a session sees ``SessionLost`` within a second while the
  daemon is gone (also for a transfer in flight at the kill), and still after
  the restart until ``reconnect()``; a new ``Client`` works at once. A read or write the
  client splits into chunks must fail within the client's timeout as well.
* A daemon stopped with SIGTERM removes the sim's shared-memory files of every
  exported or published buffer, also those whose owner session had ended.
* An ``alloc`` past ``--session-quota`` fails with ``CUDA_ERROR_OUT_OF_MEMORY``
  whose message names the quota; nothing else changes, and the session frees
  and goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuctxd.client import Client, CudaError, DaemonTimeout, SessionExpired, SessionLost
from tests.helpers import (
    DaemonProcess,
    client_processes,
    freeze,
    remove_tempdir,
    session_ids,
    short_tempdir,
    start_daemon,
    wait_for_log,
    wait_until,
)
from tests.reliability.restarts import in_flight_on
from tests.reliability.victims import transfer_forever

MiB = 1 << 20
LEASE_TTL = 1.5
#: The reaper looks every min(1 s, ttl/4); the rest is slack for a loaded machine.
REAP_MARGIN = 2.5
QUOTA = 16 * MiB
RESTART_TIMEOUT = 2.0
#: A write the Python client sends as one request (it splits only those above 8 MiB).
SINGLE_REQUEST = 8 * MiB

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lease_daemon() -> Iterator[DaemonProcess]:
    process = start_daemon("--sim-devices", "2", "--sim-memory", "128MiB", "--lease-ttl", str(LEASE_TTL),
                           "--session-quota", "16MiB")
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()[-5000:]}"
    assert "Traceback" not in process.log()


# --- a client killed mid-transfer ----------------------------------------------------------------------




def device_free(observer: Client) -> list[int]:
    return [int(observer.memory_info(d)["device_free"]) for d in (0, 1)]


@pytest.mark.parametrize("mode", ["writes", "reads", "pipelined"])
def test_a_client_killed_mid_transfer_is_reaped_and_its_memory_returns(lease_daemon: DaemonProcess,
                                                                        mode: str) -> None:
    forkserver = client_processes()
    with Client(lease_daemon.endpoint, timeout=10, name="observer") as observer:
        baseline = device_free(observer)
        parent, child = forkserver.Pipe(duplex=False)
        victim = forkserver.Process(target=transfer_forever, args=(lease_daemon.endpoint, mode, child), daemon=True)
        victim.start()
        try:
            assert parent.poll(30), "the victim never got going"
            victim_id = parent.recv()
            for _ in range(2):  # two transfers done: the next one is under way
                assert parent.poll(30), "the victim stopped transferring"
                parent.recv()
            assert victim_id in session_ids(observer)
        finally:
            victim.kill()
            victim.join(10)
            killed_at = time.monotonic()
            parent.close()
            child.close()
        assert victim.exitcode == -9
        assert observer.ping() > 0, "the daemon stopped answering after a client was killed"
        assert wait_until(lambda: victim_id not in session_ids(observer), LEASE_TTL + REAP_MARGIN), (
            f"the killed client's session was not reaped within {LEASE_TTL + REAP_MARGIN} s")
        reaped_after = time.monotonic() - killed_at
        assert reaped_after > LEASE_TTL * 0.5, "reaped long before its lease could have run out"
        assert wait_until(lambda: device_free(observer) == baseline, 5.0), (
            f"memory did not come back: {device_free(observer)} free, {baseline} before")
        for device in observer.status()["devices"]:
            assert {s["session"] for s in device["sessions"]} <= {observer.session_id}, device["sessions"]
            assert [c for c in device["contexts"] if not c["is_primary"]] == [], device["contexts"]
        wait_for_log(lease_daemon, rf"session {victim_id} \(.*\) reaped")  # its stderr is read by a thread of ours


# --- the daemon killed and restarted -----------------------------------------------------------------------


def start_daemon_at(endpoint: str, *extra: str) -> DaemonProcess:
    """A sim daemon on a given endpoint, so that a restart can reuse it."""
    return start_daemon("--sim-devices", "2", "--sim-memory", "64MiB", *extra, endpoint=endpoint)


def kill(daemon: DaemonProcess) -> None:
    if daemon.process.poll() is None:
        daemon.process.kill()
    daemon.process.wait(10)
    daemon.close_pipes()


def test_a_daemon_killed_and_restarted_on_the_same_endpoint() -> None:
    socket_dir = short_tempdir()
    endpoint = f"ipc://{socket_dir}/d.sock"
    first = start_daemon_at(endpoint)
    second: DaemonProcess | None = None
    old = Client(endpoint, timeout=RESTART_TIMEOUT, name="survivor")
    try:
        buffer = old.alloc(SINGLE_REQUEST)
        buffer.write(b"\x5a" * buffer.size)
        in_flight: list[tuple[BaseException, float]] = []
        running = threading.Event()
        killed_at = [float("inf")]

        def transfer() -> None:
            while True:
                started = time.monotonic()
                try:
                    buffer.write(b"\xa5" * buffer.size)  # one request: the client splits only above 8 MiB
                except BaseException as exc:
                    in_flight.append((exc, time.monotonic() - max(started, killed_at[0])))
                    return
                running.set()

        mover = threading.Thread(target=transfer, name="transfer-at-the-kill")
        mover.start()
        assert running.wait(10), "no transfer completed before the kill"
        killed_at[0] = time.monotonic()  # transfers run back to back: the kill lands in one
        kill(first)
        mover.join(RESTART_TIMEOUT + 3)
        assert not mover.is_alive(), "a transfer in flight at the kill hung past the client's timeout"
        assert len(in_flight) == 1 and isinstance(in_flight[0][0], SessionLost), in_flight
        assert in_flight[0][1] < RESTART_TIMEOUT + 1.0, f"the transfer in flight took {in_flight[0][1]:.1f} s to fail"

        started = time.monotonic()
        with pytest.raises(SessionLost) as gone:
            old.alloc(4096)
        assert time.monotonic() - started < 1.0, "a lost session fails at once"
        assert gone.value.name == "CUCTXD_SESSION_LOST" and gone.value.op == "alloc"

        second = start_daemon_at(endpoint)  # clears the dead daemon's socket file
        with pytest.raises(SessionLost):
            buffer.read(16)

        with Client(endpoint, timeout=5, name="after-restart") as fresh:
            assert fresh.session_id == 1, "the restarted daemon numbers its sessions afresh"
            renewed = fresh.alloc(MiB)
            renewed.write(b"\x42" * MiB)
            assert renewed.read() == b"\x42" * MiB
            assert {s["session"] for s in fresh.status()["sessions"]} == {fresh.session_id}
        old.reconnect()
        assert old.device_count() == 2
    finally:
        old.close()
        kill(first)
        if second is not None:
            assert second.stop() == 0, second.log()
        remove_tempdir(socket_dir)


def test_a_large_transfer_to_a_dead_daemon_fails_within_the_clients_timeout() -> None:
    """``Client(timeout=...)`` bounds every call, also a read or write the client splits into chunks."""
    socket_dir = short_tempdir()
    endpoint = f"ipc://{socket_dir}/d.sock"
    daemon = start_daemon_at(endpoint)
    timeout = 0.5
    client = Client(endpoint, timeout=timeout, name="large-transfer", heartbeat=False)
    try:
        buffer = client.alloc(32 * MiB)  # 8 chunks of 4 MiB either way
        kill(daemon)
        for name, transfer in (("read", buffer.read), ("write", lambda: buffer.write(bytes(buffer.size)))):
            started = time.monotonic()
            with pytest.raises((DaemonTimeout, SessionLost)):
                transfer()
            waited = time.monotonic() - started
            assert waited < timeout + 1.0, (
                f"a 32 MiB {name} to a dead daemon raised DaemonTimeout only after {waited:.1f} s, "
                f"with timeout={timeout} s (one timeout per chunk?)")
    finally:
        client.close()
        kill(daemon)
        remove_tempdir(socket_dir)


def test_a_call_waiting_on_an_shm_lane_learns_of_a_killed_daemon_within_a_probe() -> None:
    """A call on an shm lane has no socket to see the daemon go: the client probes the endpoint while
    it waits (every PROBE_EVERY s), so a killed daemon is found gone in about a second, not the timeout."""
    daemon = start_daemon("--sim-devices", "1", "--sim-memory", "16MiB")
    client = Client(daemon.endpoint, timeout=30, name="lane-waiter", heartbeat=False)
    try:
        buffer = client.alloc(64)
        buffer.read(1)
        assert client.shm_lanes == (0,)
        freeze(daemon.process.pid)  # the request is taken by nobody
        outcome: list[BaseException | bytes] = []

        def read() -> None:
            try:
                outcome.append(buffer.read(8))
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=read)
        started = time.monotonic()
        waiter.start()
        assert wait_until(lambda: "shm" in in_flight_on(client), 10, interval=0.002), "the read never reached the lane"
        kill(daemon)
        waiter.join(10)
        assert not waiter.is_alive() and len(outcome) == 1, outcome
        assert isinstance(outcome[0], SessionLost) and "nothing listens there any more" in str(outcome[0]), outcome
        assert time.monotonic() - started < 5
        assert client.shm_lanes == (0,)
    finally:
        client.close()
        kill(daemon)
        remove_tempdir(daemon.socket_dir)


def test_a_daemon_that_closes_a_lane_under_a_waiting_call_answers_it_on_the_socket() -> None:
    """A session reaped while its call waits on the lane: the daemon marks the lane closed and rings it,
    the client sends the call again on the socket, and the reply says why (the session is gone)."""
    daemon = start_daemon("--sim-devices", "1", "--sim-memory", "16MiB", "--lease-ttl", "1")
    client = Client(daemon.endpoint, timeout=30, name="reaped", heartbeat=False)
    try:
        buffer = client.alloc(64)
        buffer.read(1)
        with Client(daemon.endpoint) as observer:  # reaped: its device's worker closed the lane, then forgot it
            assert wait_until(lambda: client.session_id not in
                              {s["session"] for s in observer.status()["devices"][0]["sessions"]}, 10)
        started = time.monotonic()
        with pytest.raises(SessionExpired):
            buffer.read(8)
        assert time.monotonic() - started < 5
    finally:
        client.close()
        kill(daemon)
        remove_tempdir(daemon.socket_dir)


def test_a_stopped_daemon_frees_published_and_exported_buffers() -> None:
    """SIGTERM frees every session's memory, exported and published buffers included: a legacy export's
    memfd goes with it (its /proc path no longer opens), whoever still held a name on it."""
    daemon = start_daemon("--sim-devices", "1", "--sim-memory", "16MiB")
    try:
        with Client(daemon.endpoint, timeout=5, name="producer") as producer:  # ends before the daemon
            producer.publish(producer.alloc(4096, shareable=True), "left-behind")
        owner = Client(daemon.endpoint, timeout=0.5, name="owner", heartbeat=False)  # still open at the stop
        owner.publish(owner.alloc(8192, shareable=True), "kept")
        assert len(owner.list_shared()) == 2
        assert daemon.stop() == 0, daemon.log()
        owner.close()
        assert not Path(f"/proc/{daemon.process.pid}").exists()
    finally:
        if daemon.process.poll() is None:
            daemon.stop()
        remove_tempdir(daemon.socket_dir)


# --- a full quota ----------------------------------------------------------------------------------------


def usage(client: Client, device: int) -> tuple[int, int]:
    for dev in client.status()["devices"]:
        for entry in dev["sessions"]:
            if dev["device"] == device and entry["session"] == client.session_id:
                return entry["allocations"], entry["bytes"]
    return 0, 0


def test_a_full_quota_is_out_of_memory_naming_the_quota_and_the_session_goes_on(lease_daemon: DaemonProcess) -> None:
    with Client(lease_daemon.endpoint, timeout=10) as client, Client(lease_daemon.endpoint, timeout=10) as other:
        half = client.alloc(QUOTA // 2)
        quarter = client.alloc(QUOTA // 4, shareable=True)
        rest = client.alloc(QUOTA - half.size - quarter.size)
        half.fill(7)
        assert usage(client, 0) == (3, QUOTA)
        info = client.memory_info(0)
        assert (info["free"], info["limited_by"], info["quota"]) == (0, "quota", QUOTA)

        for size, shareable in ((1, False), (4096, True), (QUOTA, False)):
            with pytest.raises(CudaError) as full:
                client.alloc(size, shareable=shareable)
            assert (full.value.name, full.value.code) == ("CUDA_ERROR_OUT_OF_MEMORY", 2)
            assert "quota" in full.value.message and str(QUOTA) in full.value.message, full.value.message
        assert usage(client, 0) == (3, QUOTA), "a refused alloc changed the session's accounting"

        created = client.create_context(device=0)  # a context of its own does not escape the quota
        with pytest.raises(CudaError, match="quota"):
            client.alloc(1)
        created.destroy()

        assert other.alloc(QUOTA // 2, device=0).size == QUOTA // 2, "the quota is per session"
        assert client.alloc(QUOTA, device=1).size == QUOTA, "the quota is per device"

        rest.free()
        again = client.alloc(rest.size)
        again.write(b"\x33" * again.size)
        assert again.read(8, offset=again.size - 8) == b"\x33" * 8
        assert half.read(4) == b"\x07" * 4
        quarter.free()
        client.alloc(quarter.size).fill(1)
        assert usage(client, 0) == (3, QUOTA)
