"""Small shareable buffers against a daemon whose open-file limit is 1024 (issue 40, item 5).

Each ``shareable=True`` buffer used to be the only allocation of an IPC pool of its own, which holds fds in
the daemon that the fd budget never counted: on the sim, one session's ~490 small shareable allocations ran
the daemon out of descriptors and libzmq aborted it ("Too many open files"). Now a shareable buffer is a VMM
allocation of its own, which holds no fd (one is exported for each consumer that opens it): 2,000 of them
all succeed, at 2 MiB each, with the daemon's fds flat and the bystander served throughout. On a device
without VMM (``--no-sim-vmm``) they still get pools of their own, whose fds now count in the budget: the
excess is refused by name, and nobody else is.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from cuctxd import Client
from tests.adversarial.attacks import Bystander, assert_alive
from tests.adversarial.fd_attackers import allocate_shareable
from tests.helpers import DaemonProcess

#: The daemon's RLIMIT_NOFILE (soft and hard), as in the report.
OPEN_FILES = 1024
#: What the plan makes of it for one session (PROTOCOL.md, "File descriptors").
PER_SESSION = 48
#: Shareable buffers the attacker asks for.
BUFFERS = 2000
#: What a 4 KiB shareable buffer takes of the device: one VMM allocation of the 2 MiB granularity.
GRANULARITY = 2 << 20
#: Seconds the attacker may take to allocate and report.
REPORT_WITHIN = 120.0

spawn = multiprocessing.get_context("spawn")


def daemon_fds(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


@pytest.fixture
def attack_daemon_open_files() -> int:
    return OPEN_FILES


#: The sim with VMM (8 GiB a device: room for 2,000 granules; untouched pages cost nothing), and without.
WITH_AND_WITHOUT_VMM = pytest.mark.parametrize("attack_daemon_args", [("--sim-memory", "8GiB"), ("--no-sim-vmm",)],
                                               ids=["vmm", "no vmm"])


@WITH_AND_WITHOUT_VMM
def test_2000_small_shareable_buffers_hold_no_fd_and_the_bystander_is_served(
        attack_daemon: DaemonProcess, bystander: Bystander, attack_daemon_args: tuple[str, ...]) -> None:
    daemon, vmm = attack_daemon, "--no-sim-vmm" not in attack_daemon_args
    fds_before = daemon_fds(daemon)
    mine, theirs = spawn.Pipe()
    attacker = spawn.Process(target=allocate_shareable, args=(daemon.endpoint, BUFFERS, theirs), daemon=True)
    attacker.start()
    theirs.close()
    try:
        served, deadline = 0, time.monotonic() + REPORT_WITHIN
        while not mine.poll(0.05):  # the bystander is served all along
            bystander.check()
            served += 1
            assert attacker.is_alive() or mine.poll(), "the attacker died without reporting"
            assert time.monotonic() < deadline, "the attacker did not report in time"
        allocated, refusal, opened = mine.recv()
        assert served > 0 and opened == b"first"  # the consumer reached the buffer through its fd
        with Client(daemon.endpoint, timeout=10, name="observer") as observer:
            status = observer.status()
            session = max(status["devices"][0]["sessions"], key=lambda s: s["allocations"])  # the attacker's
            if vmm:
                assert (allocated, refusal) == (BUFFERS, None)
                assert session["bytes"] == BUFFERS * GRANULARITY  # each charged its 2 MiB allocation
                # the three clients' connections and lanes, and the sim's memfd of the opened buffer: not one a buffer
                assert daemon_fds(daemon) < fds_before + 64, (fds_before, daemon_fds(daemon))
            else:  # a pool of its own holds 2 fds on the sim, counted against the session's share
                assert 0 < allocated <= PER_SESSION // 2 and refusal is not None, (allocated, refusal)
                assert refusal.startswith("max_client_fds_per_session:") and "pool of its own" in refusal
                assert status["fd_budget"]["held"] >= allocated * 2
            bystander.check()
            observer.alloc(4096, shareable=True).free()  # another peer's session still gets shareable memory
    finally:
        mine.close()
        attacker.join(30)
        if attacker.is_alive():
            attacker.kill()
            attacker.join()
    assert_alive(daemon)
