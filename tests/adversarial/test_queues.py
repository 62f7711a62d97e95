"""One client against the daemon's queues: a flood of requests behind a busy worker, and large replies
it never reads. The daemon stays small, refuses what is beyond its limits by name, and serves a
bystander session on the same device within a stated bound. Each runs a real sim daemon process."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from cuctxd import Client
from cuctxd.protos.errors import CuctxError, LimitExceeded
from cuctxd.protos.messages import encode_request
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import DaemonProcess, start_daemon, wait_until

MIB = 1 << 20
#: A bystander's op on the attacked device completes within this (seconds): about one in-flight op of
#: 256 MiB, with room for a loaded CI machine (an unbounded FIFO made it wait 16 s).
BYSTANDER_BOUND_S = 2.0


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RawSession:
    """A session spoken over a bare DEALER that reads only the replies it asks for (an attacker that
    leaves the rest unread: receive high-water mark 1, so they stay in the daemon)."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.RCVHWM, 1)
        self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ids = itertools.count(1)
        self.token: str | None = None
        self.token = self.call("hello", protocol=PROTOCOL_VERSION, client="attacker", pid=os.getpid())["session"]

    def send(self, op: str, **args: Any) -> int:
        request_id = next(self.ids)
        self.socket.send(encode_request(request_id, op, self.token, args))
        return request_id

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        request_id = self.send(op, **args)
        assert self.socket.poll(10_000), f"no reply to {op}"
        frames = self.socket.recv_multipart()
        header = msgpack.unpackb(frames[0])
        assert header["id"] == request_id and "error" not in header, header
        return dict(header["result"])

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def served_within(client: Client, buffer: Any, data: bytes) -> float:
    """Seconds a bystander's read of its own buffer takes; asserts its bytes are intact."""
    started = time.perf_counter()
    assert buffer.read(len(data)) == data
    return time.perf_counter() - started


def test_a_request_flood_is_bounded_and_a_bystander_waits_about_one_op() -> None:
    daemon = start_daemon("--max-queued-bytes", "32MiB", "--sim-memory", "512MiB")
    try:
        with Client(daemon.endpoint, timeout=30) as flooder, Client(daemon.endpoint, timeout=30) as bystander:
            own = bystander.alloc(4096)
            data = bytes(range(256)) * 16
            own.write(data)
            target = flooder.alloc(MIB)
            chunk = b"\x5a" * MIB
            big = flooder.alloc(64 * MIB)
            busy = bytes(64 * MIB)  # keeps the worker busy while the 1 MiB writes pile up behind it
            waits: list[float] = []
            refused: list[BaseException] = []
            stop = threading.Event()

            def flood() -> None:
                while not stop.is_set():
                    pipe = flooder.pipeline()
                    calls = [pipe.write(big, busy), *(pipe.write(target, chunk) for _ in range(300))]
                    for call in calls:
                        try:
                            call.result()
                        except CuctxError as exc:
                            refused.append(exc)

            thread = threading.Thread(target=flood)
            thread.start()
            try:  # the bystander is measured once the flood fills the queue (its first refusal), not after a sleep
                assert wait_until(lambda: refused, 30), "the flood of 300 x 1 MiB writes never met max_queued_bytes"
                for _ in range(20):
                    waits.append(served_within(bystander, own, data))
                    time.sleep(0.02)
            finally:
                stop.set()
                thread.join(60)
            assert max(waits) < BYSTANDER_BOUND_S, waits
            assert refused, "the flood of 300 x 1 MiB writes never met max_queued_bytes = 32MiB"
            assert all(isinstance(e, LimitExceeded) and "max_queued_bytes" in str(e) for e in refused), refused[:3]
            assert flooder.ping() > 0 and target.read(16) == chunk[:16]
    finally:
        assert daemon.stop() == 0, daemon.log()


def _reads_left_unread(daemon: DaemonProcess, zmq_context: zmq.Context[Any], size: int, count: int,
                       ceiling: int) -> None:
    """An attacker sends ``count`` reads of ``size`` bytes and reads none of them: the daemon's RSS stays
    within ``ceiling`` of what it was before, a bystander is served, and RSS falls once the attacker goes."""
    with Client(daemon.endpoint, timeout=30) as bystander:
        own = bystander.alloc(4096)
        data = b"\xa5" * 4096
        own.write(data)
        attacker = RawSession(zmq_context, daemon.endpoint)
        try:
            handle = attacker.call("alloc", size=size)["buffer"]["handle"]
            attacker.call("fill", buffer=handle, value=7)
            before = rss_bytes(daemon.process.pid)
            for _ in range(count):
                attacker.send("read", buffer=handle, size=size)
            deadline = time.monotonic() + 10
            peak = rss_bytes(daemon.process.pid)
            while time.monotonic() < deadline:
                assert served_within(bystander, own, data) < BYSTANDER_BOUND_S
                peak = max(peak, rss_bytes(daemon.process.pid))
                status = bystander.status()
                queues = [q for dev in status["devices"] for q in dev["queues"]]
                if queues and all(q["queued"] == 0 for q in queues):
                    break  # every read has run or been refused
                time.sleep(0.05)
            peak = max(peak, rss_bytes(daemon.process.pid))
            assert peak - before < ceiling, f"RSS grew by {(peak - before) / MIB:.0f} MiB"
            limits = status["limits"]
            held = [q["reply_bytes"] for dev in status["devices"] for q in dev["queues"]]
            assert held and max(held) <= limits["max_reply_bytes"] + size, held
        finally:
            attacker.close()
        deadline = time.monotonic() + 20  # the lease (2 s) runs out, the session is reaped, the heap trimmed
        while rss_bytes(daemon.process.pid) - before > 64 * MIB and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rss_bytes(daemon.process.pid) - before <= 64 * MIB, "memory held for unread replies was not given back"
        assert served_within(bystander, own, data) < BYSTANDER_BOUND_S
        assert daemon.process.poll() is None


def test_large_unread_replies_are_bounded_and_given_back(zmq_context: zmq.Context[Any]) -> None:
    daemon = start_daemon("--sim-memory", "1GiB", "--lease-ttl", "2")
    try:  # six unread 256 MiB reads took an unbounded daemon to 2.9 GB
        _reads_left_unread(daemon, zmq_context, 256 * MIB, 6, ceiling=640 * MIB)
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_many_unread_1mib_replies_are_bounded_and_given_back(zmq_context: zmq.Context[Any]) -> None:
    daemon = start_daemon("--lease-ttl", "2")
    try:  # 1,500 unread 1 MiB reads added 1 GB to an unbounded daemon, kept after the client left
        _reads_left_unread(daemon, zmq_context, MIB, 1500, ceiling=400 * MIB)
    finally:
        assert daemon.stop() == 0, daemon.log()
