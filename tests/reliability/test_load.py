"""Load: many client processes at once doing mixed work on several sim devices.

:data:`PROCESSES` processes (``multiprocessing``, from ``tests.helpers.client_processes``) each open a
session and run :data:`OPS` mixed operations, chosen by a seeded generator:
alloc, write, read, fill, copy within and across devices, free, created
contexts, streams and events, and pipelines. Each process keeps a host mirror
of every buffer and writes patterns that carry its own seed, so every read
checks that the reply is the one to its request and holds the right bytes. The
processes count the requests they send, per op; the daemon logs every request
it answers (JSON lines at DEBUG), and the two counts must agree, so no request
was lost or answered twice. At the end, with every load session closed, no
allocation, created context or cached pool memory is left: ``status`` shows
none and ``mem_get_info`` is back to its baseline.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest

from cuctxd.client import Client
from tests.helpers import DaemonProcess, client_processes, remove_tempdir, start_daemon, wait_until
from tests.reliability.load_session import CALL_TIMEOUT, DEVICES, load_process
from tests.reliability.strategies import INPUTS, scaled, soak_mode

PROCESSES = 6

pytestmark = pytest.mark.timeout(0 if soak_mode() else 120)


@pytest.fixture(scope="module")
def load_daemon() -> Iterator[DaemonProcess]:
    """A long lease (the observer is idle while the load runs) and a request log to count from."""
    process = start_daemon("--sim-devices", str(DEVICES), "--sim-memory", "64MiB", "--lease-ttl", "120",
                           "--log-level", "DEBUG", "--log-format", "json")
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()[-5000:]}"
    assert "Traceback" not in process.log()


# --- the test ---------------------------------------------------------------------------------------


def answered_by_daemon(daemon: DaemonProcess) -> Counter[str]:
    """Requests the daemon logged as answered, by op (``daemon.requests`` lines at DEBUG)."""
    counts: Counter[str] = Counter()
    for line in list(daemon.stderr_lines):
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("logger") == "cuctxd.daemon.requests" and "op" in record:
            counts[record["op"]] += 1
    return counts


def test_many_processes_of_mixed_ops_lose_nothing_and_leave_nothing(load_daemon: DaemonProcess) -> None:
    ops = scaled(200)
    observer_sent: Counter[str] = Counter(["hello"])
    with Client(load_daemon.endpoint, timeout=CALL_TIMEOUT, name="observer", heartbeat=False) as observer:
        baseline = [observer.memory_info(d)["device_free"] for d in range(DEVICES)]
        observer_sent["mem_get_info"] += DEVICES
        forkserver = client_processes()
        with forkserver.Pool(PROCESSES) as pool:
            pending = pool.starmap_async(load_process, [(load_daemon.endpoint, seed, ops) for seed in range(PROCESSES)])
            results = pending.get(timeout=None if soak_mode() else 90)
        observer_sent["shm_lane"] += len(observer.shm_lanes)
        sent = sum((Counter(r["requests"]) for r in results), observer_sent)
        INPUTS["load: requests from client processes"] += sum(sum(r["requests"].values()) for r in results)
        assert sorted(r["seed"] for r in results) == list(range(PROCESSES))

        assert wait_until(lambda: answered_by_daemon(load_daemon) == sent, 10.0), (
            f"requests sent and answered differ: sent-answered {sent - answered_by_daemon(load_daemon)}, "
            f"answered-sent {answered_by_daemon(load_daemon) - sent}")

        status = observer.status()
        load_sessions = {r["session"] for r in results}
        assert not load_sessions & {s["session"] for s in status["sessions"]}, "a load session is still open"
        for device in status["devices"]:
            assert [s for s in device["sessions"] if s["allocations"] or s["bytes"]] == [], device["sessions"]
            assert [c for c in device["contexts"] if not c["is_primary"]] == [], device["contexts"]
            assert device["shares"] == []
        after = [observer.memory_info(d)["device_free"] for d in range(DEVICES)]
        assert after == baseline, "device memory (pool caches included) did not return after the sessions closed"
