"""The four faults an independent load test found (issue "Nothing lost"), as bodies that run against a daemon
of either backend: :mod:`tests.reliability.test_nothing_lost` on the sim, :mod:`tests.gpu.test_nothing_lost_gpu`
on a GPU, where the staging ring and the shm lanes are real pinned memory.

1. The staging ring made while a created context is current outlives that context.
2. A session idle across a daemon restart learns it at once, on its first call on every device.
3. A pipeline whose first error is a reply still abandons the rest once the daemon is gone.
4. A drain answers every request sent before SIGTERM, a slow reader's too, before it exits 0.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import zmq

from cuctxd.client import Client, OutOfRange, SessionLost
from tests.helpers import DaemonProcess, pattern
from tests.helpers_raw import RawPeer

KiB = 1 << 10
MiB = 1 << 20
#: What the issue allows a lost session's first call, and a pipeline's calls once the daemon is gone.
AT_ONCE_S = 1.0
#: A daemon restarted on the same endpoint: (extra arguments) -> the new process.
Restart = Callable[[str], DaemonProcess]


def staging_ring_outlives_a_created_context(endpoint: str, size: int = 64 * KiB) -> None:
    """A write large enough for the staging ring, first made inside a created context, then that context
    destroyed: later ring transfers in the primary still work."""
    with Client(endpoint, timeout=30) as owner, Client(endpoint, timeout=30) as c:
        shared = owner.alloc(4 * KiB, shareable=True)
        shared.fill(9)
        ctx = c.create_context(0)
        inside = c.alloc(size)
        inside.write(pattern(size, 1))
        assert inside.read(size) == pattern(size, 1)
        opened = c.open_shared(shared.export())  # the pool import is the process's, not the context's
        c.pop_context(0)
        ctx.destroy()
        c.set_device(0)
        buf = c.alloc(size)
        for seed in range(3):  # the ring is used, and used again
            buf.write(pattern(size, seed))
            assert buf.read(size) == pattern(size, seed)
        assert 0 in c.shm_lanes  # the lane opened inside the context still carries small ops
        buf.fill(5, size=16)
        assert buf.read(16) == bytes([5]) * 16
        opened.close()
        with c.open_shared(shared.export()) as again:
            assert again.descriptor.size == shared.size
        again = c.create_context(0)  # and in a context made after the first one went
        other = c.alloc(size)
        other.write(pattern(size, 7))
        assert other.read(size) == pattern(size, 7)
        c.pop_context(0)
        again.destroy()


def idle_session_learns_of_a_restart_at_once(daemon: DaemonProcess, restart: Restart, devices: int) -> DaemonProcess:
    """Buffers filled on each device (the shm lanes open), the daemon SIGKILLed and started again on the same
    endpoint: every later call fails by name (``SessionLost``) within :data:`AT_ONCE_S`, and a new session
    works. Returns the new daemon (the caller stops it)."""
    client = Client(daemon.endpoint, timeout=10)
    try:
        buffers = []
        for device in range(devices):
            client.set_device(device)
            buffer = client.alloc(4 * KiB)
            buffer.fill(1)
            buffers.append(buffer)
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        daemon.close_pipes()
        replacement = restart(daemon.endpoint)
        for buffer in buffers:
            for _ in range(2):
                started = time.monotonic()
                try:
                    buffer.fill(2)
                except SessionLost as lost:
                    assert "restarted" in lost.message, lost.message
                else:
                    raise AssertionError("a call on a session the restarted daemon never knew succeeded")
                took = time.monotonic() - started
                assert took < AT_ONCE_S, f"SessionLost took {took:.2f} s"
        with Client(replacement.endpoint, timeout=10) as fresh:
            fresh.alloc(4 * KiB).fill(3)
        return replacement
    finally:
        client.close()


def pipeline_gives_up_once_the_daemon_is_gone(daemon: DaemonProcess, calls: int = 8) -> float:
    """A pipeline whose first reply is an error and whose other calls can never be answered (the daemon,
    stopped once that reply was out, is SIGKILLed): returns the seconds leaving the block took, which must be
    about one liveness probe, not one per call. Raises if the pipeline did not fail with the first error."""
    with Client(daemon.endpoint, timeout=10, device_endpoints=False) as c:
        buffer = c.alloc(4 * KiB)
        batch = c.pipeline()
        batch.fill(buffer, 0, offset=8 * KiB)  # past the buffer's end: CUCTXD_ERROR_OUT_OF_RANGE
        time.sleep(0.3)  # its reply is in the client's socket now
        daemon.process.send_signal(signal.SIGSTOP)
        for value in range(calls - 1):
            batch.fill(buffer, value)
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        daemon.close_pipes()
        started = time.monotonic()
        try:
            batch.wait()
        except OutOfRange:
            return time.monotonic() - started
        raise AssertionError("the pipeline did not raise its first error")


def drain_answers_a_slow_reader(daemon: DaemonProcess, reads: int = 12, size: int = 8 * MiB) -> tuple[int, int]:
    """``reads`` reads of ``size`` sent by a client that reads its replies slowly, SIGTERM once they are
    answered: returns (replies received, the daemon's exit status)."""
    peer = RawPeer(daemon.endpoint)
    try:
        peer.socket.setsockopt(zmq.RCVHWM, 1)
        peer.socket.setsockopt(zmq.RCVBUF, 64 * KiB)
        session = peer.ok("hello", {"protocol": 1, "client": "slow-reader"})[0]["session"]
        buffer = peer.ok("alloc", {"size": size, "device": 0}, session)[0]["buffer"]["handle"]
        for _ in range(reads):
            peer.send("read", {"buffer": buffer, "size": size, "device": 0}, session)
        time.sleep(0.5)  # the daemon has produced the replies; ZeroMQ holds most of them for the slow reader
        daemon.process.send_signal(signal.SIGTERM)
        received = 0
        while received < reads:
            header, frames = peer.recv(timeout=20)
            assert "error" not in header, header
            assert len(frames[0]) == size
            received += 1
            time.sleep(0.1)
        return received, daemon.process.wait(30)
    finally:
        peer.close()
