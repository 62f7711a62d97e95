"""Leases (a SIGKILLed client is reaped) and quotas, against a real daemon."""

from __future__ import annotations

import time

import pytest

from cuctxd.client import Client, CudaError, SessionExpired
from tests.helpers import (
    DaemonProcess,
    session_ids,
    spawn_client,
    wait_for_line,
    wait_until,
)

LEASE_TTL = 1.5
#: Room for the victim's shareable buffer, which takes (and is charged) a 2 MiB VMM allocation.
QUOTA = 4 << 20


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "64MiB", "--lease-ttl", str(LEASE_TTL), "--session-quota", "4MiB",
            "--device-reserve", "4MiB")


VICTIM = """
from cuctxd.client import Client
import time
c = Client(ENDPOINT)
c.create_context(0)
buf = c.alloc(512 * 1024, device=0)
buf.fill(7)
owner = Client(ENDPOINT)
held = c.open_shared(owner.alloc(4096, device=1, shareable=True).export())
print("ready", c.session_id, flush=True)
time.sleep(600)
"""


def test_sigkilled_client_is_reaped_within_the_lease(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        baseline = [observer.mem_get_info(d)[0] for d in (0, 1)]
        with spawn_client(VICTIM, daemon.endpoint) as victim:
            session_id = int(wait_for_line(victim, "ready").split()[1])
            assert session_id in session_ids(observer)
            killed_at = time.monotonic()
            victim.kill()
        assert wait_until(lambda: session_ids(observer) == {observer.session_id}, LEASE_TTL + 3.0)
        reaped_after = time.monotonic() - killed_at
        assert reaped_after < LEASE_TTL + 3.0
        status = observer.status()
        for dev in status["devices"]:
            assert [s["allocations"] for s in dev["sessions"] if s["session"] != observer.session_id] == []
            assert dev["shares"] == []
            assert all(not c["sessions"] or c["sessions"] == [observer.session_id] for c in dev["contexts"])
        assert [observer.mem_get_info(d)[0] for d in (0, 1)] == baseline
        assert "reaped" in daemon.log()


def test_reaped_session_gets_session_expired(daemon: DaemonProcess) -> None:
    quiet = Client(daemon.endpoint, heartbeat=False)
    try:
        quiet.alloc(1024)
        with Client(daemon.endpoint) as observer:  # deliberately silent past the lease, until it is reaped
            assert wait_until(lambda: quiet.session_id not in session_ids(observer), LEASE_TTL + 3.0)
        with pytest.raises(SessionExpired) as expired:
            quiet.alloc(1024)
        assert expired.value.name == "CUCTXD_ERROR_SESSION_EXPIRED"
    finally:
        quiet.close()


def test_heartbeats_keep_an_idle_session_alive(daemon: DaemonProcess) -> None:
    """Idle on purpose until a session started with it but without heartbeats has been reaped: the
    lease ran out for both, and the background heartbeat covered the idle one."""
    with Client(daemon.endpoint) as idle, Client(daemon.endpoint, heartbeat=False) as quiet:
        buf = idle.alloc(1024)
        buf.fill(3)
        quiet.alloc(1024)
        with Client(daemon.endpoint) as observer:
            assert wait_until(lambda: quiet.session_id not in session_ids(observer), LEASE_TTL + 3.0)
            assert idle.session_id in session_ids(observer)
        assert buf.read(2) == b"\x03\x03"


def test_allocation_over_the_session_quota_fails_with_out_of_memory(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        c.alloc(QUOTA // 2)
        with pytest.raises(CudaError) as over:
            c.alloc(QUOTA // 2 + 4096)
        assert over.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        assert "quota" in over.value.message
        c.alloc(QUOTA // 2, device=1)  # the quota is per device


def test_mem_get_info_reflects_the_quota(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        c.alloc(256 * 1024)
        info = c.memory_info(0)
        assert info["limited_by"] == "quota" and info["quota"] == QUOTA
        free, total = c.mem_get_info(0)
        assert free == QUOTA - 256 * 1024
        assert total == 64 << 20


def test_device_reserve_is_kept_free(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        info = c.memory_info(0)
        assert info["reserve"] == 4 << 20
        assert info["device_free"] - info["reserve"] >= info["free"]
