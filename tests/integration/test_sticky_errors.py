"""A device that hits a sticky CUDA error is isolated: its sessions are told, others go on."""

from __future__ import annotations

import pytest

from cuctxd.client import Client, CudaError
from tests.helpers import DaemonProcess


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    # Device 1 turns sticky after 40 more context calls.
    return ("--sim-devices", "2", "--sim-memory", "64MiB", "--sim-fault", "1:40:CUDA_ERROR_ILLEGAL_ADDRESS")


def test_a_sticky_error_fails_its_device_and_spares_the_others(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        healthy = c.alloc(4096, 0)
        sick = c.alloc(4096, 1)
        with pytest.raises(CudaError) as struck:
            for _ in range(100):
                sick.write(b"x" * 64)
        assert struck.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        with pytest.raises(CudaError) as later:
            c.alloc(64, 1)
        assert later.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert "unusable" in later.value.message
        healthy.write(b"ok" * 32)
        assert healthy.read(4) == b"okok"
        status = c.status()
        assert status["devices"][0]["failed"] is None
        assert status["devices"][1]["failed"].startswith("CUDA_ERROR_ILLEGAL_ADDRESS")
    with Client(daemon.endpoint) as fresh:
        assert fresh.alloc(64, 0).read(2) == b"\0\0"
        with pytest.raises(CudaError):
            fresh.alloc(64, 1)
