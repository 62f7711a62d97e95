"""The daemon keeps a device's primary context for ``primary_keep`` seconds after its last user let go: the
next session binds the same context (no new one made), the closed session's memory is freed meanwhile,
``status`` and ``cuctx status`` say how long it is kept, and it is released once the time has passed.

The handlers' side of it (kept, taken over, released, made anew; ``primary_keep`` 0 releasing at once) is
tests/unit/daemon/device/test_device_state.py's and test_kept_host_buffers.py's, against a plain DeviceState;
here, the same through a daemon's timer, its status and the CLI."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cuctxd import Client
from tests.helpers import DaemonProcess, cuctx, wait_until


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    """The module's daemon keeps a primary context for 30 s (the tests of its release start their own)."""
    return ("--sim-devices", "1", "--primary-keep", "30")


def primary(client: Client, device: int = 0) -> dict[str, object]:
    return dict(client.status()["devices"][device]["primary_context"])


def test_a_kept_primary_context_serves_the_next_session(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as first:
        first.alloc(1 << 20)
        made = first.current_context()
        assert made is not None and made.is_primary
    with Client(daemon.endpoint) as observer:
        state = primary(observer)
        assert state["active"] is True and state["references"] == 0, state
        assert 0 < float(state["kept_for"]) <= 30, state  # type: ignore[arg-type]
        assert observer.status()["devices"][0]["memory"]["allocated"] == 0, "the closed session's buffer stays"
        text = cuctx("--endpoint", daemon.endpoint, "status")
        assert "primary context active, 0 reference(s), kept" in text.stdout, text.stdout
        observer.alloc(64)  # binds the primary again: the kept one
        again = observer.current_context()
        assert again is not None and again.context_id == made.context_id
        assert primary(observer)["kept_for"] is None and primary(observer)["references"] == 1


def test_a_kept_primary_context_is_released_after_primary_keep(start_daemons: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemons("--sim-devices", "1", "--primary-keep", "0.3", "--lease-ttl", "1")
    with Client(daemon.endpoint) as first:
        first.alloc(64)
        made = first.current_context()
        assert made is not None
    with Client(daemon.endpoint) as observer:
        assert wait_until(lambda: primary(observer)["active"] is False, timeout=5), primary(observer)
        assert primary(observer)["kept_for"] is None
        observer.alloc(64)
        again = observer.current_context()
        assert again is not None and again.context_id != made.context_id, "a released primary is made anew"


def test_a_freed_host_buffer_serves_the_next_process_of_the_user_that_asks_for_reuse(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as first:
        host = first.host_alloc(2 << 20, 0, reuse=True)
        memoryview(host)[:5] = b"ring!"
        host.free()
        assert first.status()["devices"][0]["host_kept"] == {"bytes": 2 << 20, "buffers": 1}
        text = cuctx("--endpoint", daemon.endpoint, "status").stdout
        assert "host buffers kept page-locked for reuse: 1, 2 MiB" in text, text
    with Client(daemon.endpoint) as second:
        fresh = second.host_alloc(2 << 20, 0)
        assert bytes(memoryview(fresh)[:5]) == bytes(5), "without reuse: new, zeroed memory"
        again = second.host_alloc(2 << 20, 0, reuse=True)
        assert bytes(memoryview(again)[:5]) == b"ring!"
        assert second.status()["devices"][0]["host_kept"] == {"bytes": 0, "buffers": 0}
        fresh.free()
        again.free()
