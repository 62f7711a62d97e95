"""Load with random SIGKILLs: many client processes doing verified data ops, some killed mid-work.

:data:`PROCESSES` client processes (``tests.helpers.client_processes``; targets in
:mod:`tests.adversarial.load_clients`) each check every read against what they
wrote. While they run, :data:`KILLS` of them, chosen at random, are SIGKILLed at
random moments. Asserted: no mismatch in any survivor, the daemon alive, a
bystander's bytes intact and its reads served within its bound throughout, the
killed sessions reaped and their memory back within ``lease_ttl`` +
:data:`REAP_BOUND` s of the last kill, device memory back to its baseline once
everyone is gone, and the daemon's RSS growth under :data:`RSS_GROWTH_CEILING`.
The figures go to the terminal summary (``attacks.FIGURES``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from cuctxd import Client
from tests.adversarial.attacks import FIGURES, Bystander, assert_alive, rss_bytes, scaled, soak_mode
from tests.adversarial.load_clients import DEVICES, verified_client
from tests.helpers import DaemonProcess, client_processes

PROCESSES = 64
KILLS = 16
LEASE_TTL = 2.0
#: Seconds past ``LEASE_TTL`` (after the last kill) within which the killed sessions' memory must be back.
REAP_BOUND = 3.0
#: Most bytes the daemon's RSS may grow by under the load (buffers are 1 MiB per process on the sim).
RSS_GROWTH_CEILING = 400 * 1024 * 1024

pytestmark = pytest.mark.timeout(0 if soak_mode() else 150)


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    return ("--lease-ttl", str(LEASE_TTL), "--sim-devices", str(DEVICES))


def device_free(observer: Client) -> list[int]:
    return [observer.memory_info(d)["device_free"] for d in range(DEVICES)]


def open_sessions(observer: Client) -> set[int]:
    return {s["session"] for s in observer.status()["sessions"]}


def test_killed_clients_leave_nothing_and_survivors_see_only_their_bytes(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    ops = scaled(60)
    rng = random.Random(14)
    pid = attack_daemon.process.pid
    rss_before = rss_bytes(pid)
    forkserver = client_processes()
    with Client(attack_daemon.endpoint, timeout=30, name="observer") as observer:
        baseline = device_free(observer)
        pipes: dict[Connection, int] = {}
        processes: dict[int, BaseProcess] = {}
        for seed in range(PROCESSES):
            receiver, sender = forkserver.Pipe(duplex=False)
            processes[seed] = forkserver.Process(target=verified_client,
                                                 args=(attack_daemon.endpoint, seed, ops, sender), daemon=True)
            processes[seed].start()
            sender.close()
            pipes[receiver] = seed
        victims = set(rng.sample(range(PROCESSES), KILLS))
        kill_at: dict[int, float] = {}  # victim -> when, once it has started
        sessions: dict[int, int] = {}
        reports: dict[int, dict[str, Any]] = {}
        killed: set[int] = set()
        bystander_worst = 0.0
        last_kill = 0.0
        deadline = float("inf") if soak_mode() else time.monotonic() + 100
        try:
            while pipes:
                assert time.monotonic() < deadline, f"the load did not finish: {len(reports)} reports"
                for receiver in wait(list(pipes), timeout=0.1):
                    seed = pipes[receiver]
                    try:
                        kind, body = receiver.recv()
                    except EOFError:  # the process has gone: killed, or failed before reporting
                        del pipes[receiver]
                        receiver.close()
                        continue
                    if kind == "started":
                        sessions[seed] = body
                        if seed in victims:
                            kill_at[seed] = time.monotonic() + rng.uniform(0.0, 1.0)
                    else:
                        reports[seed] = body
                for seed, when in list(kill_at.items()):
                    if time.monotonic() >= when and seed not in reports:
                        processes[seed].kill()
                        processes[seed].join()
                        killed.add(seed)
                        last_kill = time.monotonic()
                        del kill_at[seed]
                bystander_worst = max(bystander_worst, bystander.check())
                assert_alive(attack_daemon)
        finally:
            for process in processes.values():
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join()
        failed = {seed: p.exitcode for seed, p in processes.items() if seed not in killed and p.exitcode != 0}
        assert failed == {}, f"client processes failed (exit codes): {failed}"
        killed_sessions = {sessions[s] for s in killed}
        while killed_sessions & open_sessions(observer):
            assert time.monotonic() - last_kill < LEASE_TTL + REAP_BOUND, "killed sessions were not reaped in time"
            bystander_worst = max(bystander_worst, bystander.check())
            time.sleep(0.05)
        reaped = time.monotonic() - last_kill
        while device_free(observer) != baseline:
            assert time.monotonic() - last_kill < LEASE_TTL + REAP_BOUND, (
                f"device memory {device_free(observer)} not back to {baseline}")
            time.sleep(0.05)
        reclaimed = time.monotonic() - last_kill
        status = observer.status()
        own = {bystander.client.session_id, observer.session_id}
    requests = sum((Counter(r["requests"]) for r in reports.values()), Counter())
    errors = sum((Counter(r["errors"]) for r in reports.values()), Counter())
    mismatches = sum(r["mismatches"] for r in reports.values())
    rss_growth = rss_bytes(pid) - rss_before
    FIGURES["test_load_kills"] = [
        f"processes {PROCESSES}, killed {len(killed)}, survivors reporting {len(reports)}, ops each {ops}",
        f"requests by survivors: {sum(requests.values())} {dict(sorted(requests.items()))}",
        f"errors by name: {dict(errors) or 'none'}; mismatches: {mismatches}",
        f"killed sessions reaped {reaped:.2f} s, their memory back {reclaimed:.2f} s after the last kill "
        f"(lease_ttl {LEASE_TTL} s, bound {LEASE_TTL + REAP_BOUND} s)",
        f"bystander's slowest read {bystander_worst * 1000:.1f} ms; daemon RSS growth {rss_growth / 2**20:.1f} MiB",
    ]
    assert killed and len(killed) + len(reports) == PROCESSES
    assert mismatches == 0
    assert errors == Counter(), errors
    assert [s for d in status["devices"] for s in d["sessions"] if s["bytes"] and s["session"] not in own] == []
    assert rss_growth < RSS_GROWTH_CEILING, f"daemon RSS grew by {rss_growth / 2**20:.0f} MiB"
