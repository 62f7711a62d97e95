"""A daemon restarted, and one drained, while client processes keep it busy (issue "Nothing lost").

* **Restart under load.** The daemon SIGKILLed and started again on the same endpoint while
  :data:`PROCESSES` processes run ops back to back over the shm lanes, the staging ring and the socket:
  every process's first failing op fails by name (``SessionLost``) within :data:`AT_ONCE_S` of when it
  started or of the restart, whichever is later: never a timeout.
* **Drain under load.** SIGTERM while they run: every op started before the signal is answered (done,
  or refused with ``CUCTXD_ERROR_SHUTTING_DOWN``), none times out, and the daemon exits 0.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tests.helpers import client_processes, remove_tempdir, start_daemon
from tests.reliability.busy_session import busy_process

PROCESSES = 4
DEVICES = 2
SIM = ("--sim-devices", str(DEVICES), "--sim-memory", "256MiB")
#: What a failing op may take past the restart (one liveness probe, 1 s, and a loaded 2-core machine's slack).
AT_ONCE_S = 1.5

pytestmark = pytest.mark.timeout(120)


def _run_busy(endpoint: str) -> tuple[multiprocessing.pool.Pool, multiprocessing.pool.AsyncResult]:  # type: ignore[type-arg]
    forkserver = client_processes()
    manager = forkserver.Manager()
    events = [manager.Event() for _ in range(PROCESSES)]
    pool = forkserver.Pool(PROCESSES)
    pending = pool.starmap_async(busy_process, [(endpoint, seed, events[seed], DEVICES) for seed in range(PROCESSES)])
    for event in events:
        assert event.wait(60), "a busy process never got going"
    pool.manager = manager  # type: ignore[attr-defined]  # kept alive with the pool
    return pool, pending


def test_after_a_restart_under_load_every_session_fails_by_name_at_once() -> None:
    daemon = start_daemon(*SIM)
    pool, pending = _run_busy(daemon.endpoint)
    try:
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        daemon.close_pipes()
        killed = time.monotonic()
        replacement = start_daemon(*SIM, endpoint=daemon.endpoint)
        ready = time.monotonic()
        results = pending.get(timeout=60)
    finally:
        pool.terminate()
    try:
        assert len(results) == PROCESSES
        for outcomes in results:
            begin, end, outcome = outcomes[-1]
            assert outcome == "CUCTXD_SESSION_LOST", outcomes[-3:]
            assert all(name == "ok" for *_, name in outcomes[:-1]), [o for o in outcomes if o[2] != "ok"][:3]
            assert begin < killed or end - ready < AT_ONCE_S, (begin, end, killed, ready)
            assert end - max(begin, ready) < AT_ONCE_S, f"the failing op ended {end - max(begin, ready):.2f} s late"
        assert replacement.stop() == 0, replacement.log()
    finally:
        remove_tempdir(replacement.socket_dir)


def test_a_drain_under_load_answers_every_op_started_before_sigterm() -> None:
    daemon = start_daemon(*SIM)
    pool, pending = _run_busy(daemon.endpoint)
    try:
        signalled = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        code = daemon.process.wait(30)
        results = pending.get(timeout=60)
    finally:
        pool.terminate()
        daemon.close_pipes()
        remove_tempdir(daemon.socket_dir)
    assert code == 0, daemon.log()[-3000:]
    assert len(results) == PROCESSES
    answered = ("ok", "CUCTXD_ERROR_SHUTTING_DOWN")
    for outcomes in results:
        before = [o for o in outcomes if o[0] < signalled]
        assert before and all(name in answered for *_, name in before), [o for o in before if o[2] not in answered]
        assert all(name != "CUCTXD_TIMEOUT" for *_, name in outcomes)
        assert outcomes[-1][2] == "CUCTXD_SESSION_LOST"  # the daemon gone: found at once, not timed out
