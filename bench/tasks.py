"""What one throughput client process does per step, against the daemon or the bare echo.

Each task connects and warms up in its constructor, does one request per
:meth:`step`, and releases everything in :meth:`close`. They run in the
processes of :mod:`bench.pool`.
"""

from __future__ import annotations

from typing import Any

from bench.anchors import RawClient

_WARMUP_STEPS = 200


class DaemonPing:
    """``Client.ping``: the daemon's front thread only."""

    def __init__(self, endpoint: str) -> None:
        from cuctxd.client import Client

        self.client = Client(endpoint, name="bench-throughput")
        self.step = self.client.ping
        for _ in range(_WARMUP_STEPS):
            self.step()

    def close(self) -> None:
        self.client.close()


class DaemonRead:
    """``Buffer.read_into`` of ``size`` bytes: front thread, device worker, driver, and back."""

    def __init__(self, endpoint: str, size: int, device: int = 0) -> None:
        from cuctxd.client import Client

        self.client = Client(endpoint, name="bench-throughput")
        self.buffer = self.client.alloc(size, device=device)
        self.out = bytearray(size)
        for _ in range(_WARMUP_STEPS):
            self.step()

    def step(self) -> None:
        self.buffer.read_into(self.out)

    def close(self) -> None:
        self.client.close()


class EchoPing:
    """The bare echo: one msgpack header each way."""

    def __init__(self, endpoint: str) -> None:
        self.client = RawClient(endpoint)
        self.step = self.client.ping
        for _ in range(_WARMUP_STEPS):
            self.step()

    def close(self) -> None:
        self.client.close()


class EchoRead:
    """The bare echo answering with ``size`` payload bytes, received into a buffer."""

    def __init__(self, endpoint: str, size: int) -> None:
        self.client = RawClient(endpoint)
        self.args = {"size": size}
        self.out = bytearray(size)
        for _ in range(_WARMUP_STEPS):
            self.step()

    def step(self) -> None:
        self.client.call("source", self.args, into=self.out)

    def close(self) -> None:
        self.client.close()


TASKS: dict[str, Any] = {
    "daemon_ping": DaemonPing,
    "daemon_read": DaemonRead,
    "echo_ping": EchoPing,
    "echo_read": EchoRead,
}
