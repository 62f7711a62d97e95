"""Many sessions at once, and one busy device not holding up another."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from cuctxd.client import Client
from tests.helpers import DaemonProcess
from tests.helpers_raw import raw_peer

MiB = 1 << 20
BIG = 32 * MiB
#: A generous bound on any single call while the daemon is busy elsewhere.
CALL_TIMEOUT = 10.0


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    """Room for several 32 MiB buffers per device."""
    return ("--sim-devices", "2", "--sim-memory", "256MiB")


def timed(call: Callable[[], object]) -> float:
    """Seconds ``call`` took."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run_threads(targets: list[Callable[[], None]], timeout: float = 40.0) -> None:
    """Run each target on its own thread; re-raise the first failure in the test."""
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                target()
            except BaseException as exc:
                failures.append(exc)
        return body

    threads = [threading.Thread(target=guarded(t), name=f"test-worker-{n}") for n, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    if failures:
        raise failures[0]


def session_work(endpoint: str, seed: int, device: int, rounds: int) -> Callable[[], None]:
    def work() -> None:
        other_device = 1 - device
        with Client(endpoint, timeout=CALL_TIMEOUT, name=f"worker-{seed}") as client:
            client.set_device(device)
            for n in range(rounds):
                size = 1000 + (seed * 131 + n * 17) % 50_000
                data = bytes([(seed + n) % 256]) * (size // 2) + os.urandom(size - size // 2)
                src = client.alloc(size)
                assert src.device == device
                assert src.write(data) == size
                src.fill((seed * 3 + n) % 256, offset=10, size=20)
                expected = data[:10] + bytes([(seed * 3 + n) % 256]) * 20 + data[30:]
                dst = client.alloc(size, device=other_device if n % 3 == 0 else device)
                assert src.copy_to(dst) == size
                assert dst.read() == expected
                assert src.read(100, offset=size - 100) == expected[-100:]
                created = client.create_context()
                assert [c.handle for c in client.context_stack()][-1] == created.handle
                created.destroy()
                assert client.get_device() == device
                src.free()
                dst.free()
            assert client.context_stack()[-1].is_primary
            entries = [s for d in client.status()["devices"] for s in d["sessions"]
                       if s["session"] == client.session_id]
            assert sum(e["allocations"] for e in entries) == 0
    return work


def test_concurrent_sessions_on_both_devices_get_correct_results(daemon: DaemonProcess) -> None:
    run_threads([session_work(daemon.endpoint, seed, seed % 2, rounds=25) for seed in range(6)])
    with Client(daemon.endpoint, timeout=CALL_TIMEOUT) as observer:
        assert observer.mem_get_info(device=0) == (256 * MiB, 256 * MiB)
        assert observer.mem_get_info(device=1) == (256 * MiB, 256 * MiB)
        assert [s["session"] for s in observer.status()["sessions"]] == [observer.session_id]


def test_threads_sharing_one_client_are_serialised_correctly(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, timeout=CALL_TIMEOUT) as shared:
        buffers = [shared.alloc(4096, device=n % 2) for n in range(4)]

        def hammer(n: int) -> Callable[[], None]:
            def body() -> None:
                for round_ in range(50):
                    value = (n * 50 + round_) % 256
                    buffers[n].fill(value)
                    assert buffers[n].read() == bytes([value]) * 4096
            return body

        run_threads([hammer(n) for n in range(4)])


def test_device_1_is_answered_while_device_0_copies(daemon: DaemonProcess) -> None:
    stop = threading.Event()
    busy = threading.Event()
    copies: list[int] = []

    def copy_loop() -> None:
        with Client(daemon.endpoint, timeout=CALL_TIMEOUT, name="busy") as client:
            src = client.alloc(BIG, device=0)
            dst = client.alloc(BIG, device=0)
            src.fill(0x5A)
            while not stop.is_set():
                assert src.copy_to(dst) == BIG
                copies.append(1)
                busy.set()
            assert dst.read(4096, offset=BIG - 4096) == b"\x5a" * 4096

    def device_1_work() -> None:
        assert busy.wait(CALL_TIMEOUT), "the copy loop never got going"
        try:
            with Client(daemon.endpoint, timeout=CALL_TIMEOUT, name="light") as client:
                for n in range(30):
                    client.ping()
                    buffer = client.alloc(4096, device=1)
                    buffer.write(bytes([n]) * 4096)
                    assert buffer.read() == bytes([n]) * 4096
                    buffer.free()
                    assert client.mem_get_info(device=1)[0] == 256 * MiB
        finally:
            stop.set()

    run_threads([copy_loop, device_1_work])
    assert copies, "device 0 did no copy at all"


def test_a_pipelined_backlog_on_device_0_leaves_device_1_answering(daemon: DaemonProcess) -> None:
    """Many 32 MiB copies queued on device 0 at once: the front and device 1 still answer about
    as fast as when idle, far sooner than the backlog drains, and every queued copy is answered,
    in order."""
    backlog = 40
    with raw_peer(daemon.endpoint) as peer, Client(daemon.endpoint, timeout=CALL_TIMEOUT) as light:
        token = peer.hello()
        src = peer.ok("alloc", {"size": BIG, "device": 0}, token)[0]["buffer"]["handle"]
        dst = peer.ok("alloc", {"size": BIG, "device": 0}, token)[0]["buffer"]["handle"]
        peer.ok("fill", {"buffer": src, "value": 0x3C, "device": 0}, token)
        buffer = light.alloc(4096, device=1)
        idle_ping = min(light.ping() for _ in range(5))
        idle_read = min(timed(buffer.read) for _ in range(5))

        sent = time.perf_counter()
        ids = [peer.send("copy", {"src": src, "dst": dst, "device": 0}, token) for _ in range(backlog)]
        buffer.write(b"\x01" * 4096)
        started = time.perf_counter()
        assert buffer.read() == b"\x01" * 4096
        busy_read = time.perf_counter() - started
        busy_ping = light.ping()

        replies = [peer.recv(timeout=CALL_TIMEOUT)[0] for _ in range(backlog)]
        drained = time.perf_counter() - sent
        # Generous: a loaded 2-core machine switches threads every few ms. Stuck behind device 0,
        # either call would instead take about as long as the backlog does to drain.
        assert busy_ping < max(30 * idle_ping, 0.1), f"ping {busy_ping * 1e3:.1f} ms, idle {idle_ping * 1e3:.1f} ms"
        assert busy_read < max(30 * idle_read, 0.1), f"read {busy_read * 1e3:.1f} ms, idle {idle_read * 1e3:.1f} ms"
        assert busy_ping + busy_read < drained / 2, f"the backlog drained in {drained * 1e3:.0f} ms"
        assert [r["id"] for r in replies] == ids
        assert all(r["ok"] and r["result"] == {"size": BIG} for r in replies)
        tail = peer.ok("read", {"buffer": dst, "offset": BIG - 16, "device": 0}, token)[1]
        assert tail == [b"\x3c" * 16]
