"""Graceful drain on SIGTERM: work in flight finishes and is answered, new work is refused, then exit 0.

The daemon is kept busy with fills of a large buffer queued on one device
worker: each takes milliseconds, so a few hundred keep it busy for seconds.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from cuctxd.protos.messages import pack
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon

MiB = 1 << 20
BUFFER = 512 * MiB


class Peer:
    """A bare DEALER speaking the wire protocol, to keep many requests in flight at once."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._ids = itertools.count(1)
        self.token: str | None = None

    def send(self, op: str, args: dict[str, Any] | None = None, *, session: bool = True) -> int:
        request_id = next(self._ids)
        header: dict[str, Any] = {"id": request_id, "op": op, "args": args or {}}
        if session and self.token is not None:
            header["session"] = self.token
        self.socket.send(pack(header))
        return request_id

    def recv(self, timeout: float = 20.0) -> dict[str, Any]:
        if not self.socket.poll(int(timeout * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply within {timeout} s")
        header, *_ = self.socket.recv_multipart()
        reply: dict[str, Any] = msgpack.unpackb(header, raw=False)
        return reply

    def call(self, op: str, args: dict[str, Any] | None = None, *, session: bool = True) -> dict[str, Any]:
        request_id = self.send(op, args, session=session)
        reply = self.recv()
        assert reply["id"] == request_id
        return reply

    def ok(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = self.call(op, args)
        assert reply["ok"], reply
        result: dict[str, Any] = reply["result"]
        return result

    def close(self) -> None:
        self.socket.close()


def error_name(reply: dict[str, Any]) -> str | None:
    return None if reply["ok"] else str(reply["error"]["name"])


@pytest.fixture
def busy() -> Iterator[tuple[DaemonProcess, Peer, int]]:
    """A daemon, a peer with a session, and a warmed-up buffer handle to fill."""
    process = start_daemon("--sim-devices", "1", "--sim-memory", "1GiB", "--drain-timeout", "15")
    peer = Peer(process.endpoint)
    try:
        peer.token = peer.ok("hello", {"protocol": PROTOCOL_VERSION, "client": "drain-test", "pid": 1})["session"]
        handle = peer.ok("alloc", {"size": BUFFER})["buffer"]["handle"]
        peer.ok("fill", {"buffer": handle, "value": 1})  # touch the memory once, so each fill costs the same
        yield process, peer, handle
    finally:
        peer.close()
        if process.process.poll() is None:
            process.process.kill()
        process.stop()
        remove_tempdir(process.socket_dir)


def queue_fills(peer: Peer, handle: int, count: int) -> list[int]:
    ids = [peer.send("fill", {"buffer": handle, "value": n % 256}) for n in range(count)]
    first = peer.recv()  # the worker has started on them, so the front has taken them all
    assert first["id"] == ids[0] and first["ok"], first
    return ids[1:]


def seconds_of_fills(peer: Peer, handle: int, seconds: float) -> int:
    """How many fills keep the worker busy for about ``seconds`` (timed here, as speeds differ)."""
    started = time.monotonic()
    for n in range(10):
        peer.ok("fill", {"buffer": handle, "value": n})
    each = max((time.monotonic() - started) / 10, 1e-4)
    return min(20_000, int(seconds / each) + 1)


def wait_until_draining(endpoint: str, timeout: float = 10.0) -> None:
    """Ping without a session until the answer is CUCTXD_ERROR_SHUTTING_DOWN."""
    probe = Peer(endpoint)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if error_name(probe.call("ping", session=False)) == "CUCTXD_ERROR_SHUTTING_DOWN":
                return
            time.sleep(0.01)
        raise AssertionError("the daemon never started draining")
    finally:
        probe.close()


def test_sigterm_finishes_work_in_flight_and_refuses_new_work(busy: tuple[DaemonProcess, Peer, int]) -> None:
    process, peer, handle = busy
    pending = set(queue_fills(peer, handle, seconds_of_fills(peer, handle, 2.0)))
    process.process.send_signal(signal.SIGTERM)
    wait_until_draining(process.endpoint)

    newcomer = Peer(process.endpoint)
    try:
        hello = newcomer.call("hello", {"protocol": PROTOCOL_VERSION, "client": "late", "pid": 2})
        assert error_name(hello) == "CUCTXD_ERROR_SHUTTING_DOWN"
        assert "shutting down" in hello["error"]["message"]
    finally:
        newcomer.close()
    late = peer.send("fill", {"buffer": handle, "value": 9})

    answers: dict[int, dict[str, Any]] = {}
    while len(answers) < len(pending) + 1:
        reply = peer.recv()
        answers[reply["id"]] = reply
    assert error_name(answers.pop(late)) == "CUCTXD_ERROR_SHUTTING_DOWN"
    assert set(answers) == pending
    assert all(reply["ok"] for reply in answers.values()), [r for r in answers.values() if not r["ok"]]

    assert process.process.wait(20) == 0, process.log()
    assert not process.socket_path.exists()
    assert "drained in" in process.log()
    assert "Traceback" not in process.log()


def test_a_second_signal_exits_at_once(busy: tuple[DaemonProcess, Peer, int]) -> None:
    process, peer, handle = busy
    queue_fills(peer, handle, seconds_of_fills(peer, handle, 5.0))
    process.process.send_signal(signal.SIGTERM)
    wait_until_draining(process.endpoint)
    signalled = time.monotonic()
    process.process.send_signal(signal.SIGTERM)
    code = process.process.wait(10)
    assert time.monotonic() - signalled < 2.0
    assert code != 0
    assert not process.socket_path.exists()
    assert "second SIGTERM" in process.log()


def test_the_drain_is_bounded_by_drain_timeout() -> None:
    process = start_daemon("--sim-devices", "1", "--sim-memory", "1GiB", "--drain-timeout", "0.5")
    peer = Peer(process.endpoint)
    try:
        peer.token = peer.ok("hello", {"protocol": PROTOCOL_VERSION, "client": "drain-test", "pid": 1})["session"]
        handle = peer.ok("alloc", {"size": BUFFER})["buffer"]["handle"]
        peer.ok("fill", {"buffer": handle, "value": 1})
        queue_fills(peer, handle, seconds_of_fills(peer, handle, 8.0))
        signalled = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        code = process.process.wait(10)
        took = time.monotonic() - signalled
    finally:
        peer.close()
        process.stop()
        remove_tempdir(process.socket_dir)
    assert took < 5.0, took  # 0.5 s of drain, at most 1 s for the workers, then out
    assert "drain timed out after 0.5 s" in process.log()
    # A drain that timed out dropped requests unanswered: the exit status says so (1), as after a second signal.
    assert code == 1, process.log()
    assert not process.socket_path.exists()
