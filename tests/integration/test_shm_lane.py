"""Device ops through shm lanes, against a real daemon: which calls take a lane, that they keep their
order with the socket's, that errors and bytes come back as over ZeroMQ, and that lanes end with their
sessions."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cuctxd import Client, LimitExceeded, UnknownHandle
from cuctxd.client.wire import build, shm_lane
from tests.helpers import DaemonProcess, running_daemon, wait_until


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "256MiB")


def lanes(observer: Client) -> list[int]:
    return [device["shm_lanes"] for device in observer.status()["devices"]]


def test_a_sessions_first_device_op_opens_its_lane_to_that_device(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        with Client(daemon.endpoint) as c:
            assert lanes(observer) == [0, 0]
            buf = c.alloc(4096)
            buf.write(b"through the lane")
            assert buf.read(16) == b"through the lane"
            assert lanes(observer) == [1, 0]
            other = c.alloc(64, device=1)
            other.fill(7)
            assert other.read(4) == b"\x07" * 4
            assert lanes(observer) == [1, 1]
        assert wait_until(lambda: lanes(observer) == [0, 0], timeout=5)


def test_errors_come_back_typed(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(64)
        buf.free()
        with pytest.raises(UnknownHandle):
            buf.read(8)
        assert c.alloc(64).read(8) is not None  # the lane goes on after an error


def test_the_lane_and_a_pipeline_keep_the_order_they_were_sent_in(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(4096)
        buf.read(1)  # the lane is open from here on
        with c.pipeline() as p:
            for value in range(50):
                p.write(buf, bytes([value]) * 64)
        assert buf.read(64) == bytes([49]) * 64  # the lane's read waited for the pipeline's writes
        buf.write(b"\xaa" * 64)
        with c.pipeline() as p:
            read = p.read(buf, 64)
        assert read.result() == b"\xaa" * 64


@pytest.mark.parametrize("size", [1, 60 << 10, 63 << 10 | 512])
def test_reads_near_the_area_size_land_whole(daemon: DaemonProcess, size: int) -> None:
    """Up to about 63 KiB a read's reply fits the lane's area; just above, it takes the socket."""
    data = bytes(range(256)) * (size // 256 + 1)
    with Client(daemon.endpoint) as c:
        buf = c.alloc(size)
        buf.write(data[:size])
        assert buf.read() == data[:size]
        out = bytearray(size)
        assert buf.read_into(out) == size and bytes(out) == data[:size]


def test_stream_ordered_allocation_through_the_lane(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buffers = [c.alloc_async(4096) for _ in range(100)]
        for buf in buffers:
            c.free_async(buf)
        c.synchronize()
        assert c.alloc(64).read(1) is not None


def test_threads_sharing_a_client_each_get_their_own_replies(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        buffers = [c.alloc(64) for _ in range(4)]
        for index, buf in enumerate(buffers):
            buf.write(bytes([index]) * 64)
        wrong: list[int] = []

        def reader(index: int) -> None:
            for _ in range(200):
                if buffers[index].read(64) != bytes([index]) * 64:
                    wrong.append(index)

        threads = [threading.Thread(target=reader, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not wrong and not any(thread.is_alive() for thread in threads)


def test_a_thread_waiting_on_an_early_write_does_not_hold_up_its_data_ring(daemon: DaemonProcess) -> None:
    """One thread's 8 MiB writes go early (their copy waits on copy threads, letting the others run);
    another thread's small reads on the same lane wait for them (the daemon answers an early request
    only after its data ring) and must not keep the writer from ringing it."""
    size = 8 << 20
    with Client(daemon.endpoint, timeout=5) as c:  # a deadlock would end in DaemonTimeout
        big, small = c.alloc(size), c.alloc(64)
        small.write(b"s" * 64)
        failures: list[BaseException] = []

        def writer() -> None:
            try:
                for index in range(20):
                    big.write(bytes([index]) * size)
            except BaseException as error:
                failures.append(error)

        def reader() -> None:
            try:
                for _ in range(500):
                    assert small.read(64) == b"s" * 64
            except BaseException as error:
                failures.append(error)

        threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures and not any(thread.is_alive() for thread in threads)
        assert big.read(size) == bytes([19]) * size
        assert c.shm_lanes == (0,)


def test_a_client_without_device_endpoints_opens_no_lane(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer, Client(daemon.endpoint, device_endpoints=False) as c:
        c.alloc(64).write(b"socket only")
        assert lanes(observer) == [0, 0]


def test_beyond_max_shm_lanes_a_session_keeps_to_the_socket(start_daemons: Callable[..., DaemonProcess]) -> None:
    process = start_daemons("--sim-devices", "1", "--sim-memory", "16MiB", "--max-shm-lanes", "1")
    with Client(process.endpoint) as first, Client(process.endpoint) as second:
        first.alloc(64).read(1)
        buf = second.alloc(64)
        buf.write(b"by socket")
        assert buf.read(9) == b"by socket"
        assert (first.shm_lanes, second.shm_lanes) == ((0,), ())
        assert lanes(first) == [1]
        with pytest.raises(LimitExceeded, match="max_shm_lanes"):  # what the client fell back from
            second.run(build.shm_lane(0))
        assert first.alloc(64).read(1) is not None  # the lane's session is still served


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_busy_polling_answers_as_usual_polls_for_its_window_then_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_lane, "BUSY_POLL_S", 500e-6)
    with running_daemon("--busy-poll-us", "400000") as process:
        with Client(process.endpoint) as c:
            buf = c.alloc(1 << 20)
            for value in range(200):
                buf.write(bytes([value]) * 100)
                assert buf.read(100) == bytes([value]) * 100
            assert c.shm_lanes == (0,)
            before = _cpu_seconds(process.process.pid)
            time.sleep(0.3)  # within the 0.4 s window after the last request: the worker polls
            polling = _cpu_seconds(process.process.pid) - before
            time.sleep(0.2)
            before = _cpu_seconds(process.process.pid)
            time.sleep(1.0)  # long after it: the worker sleeps
            idle = _cpu_seconds(process.process.pid) - before
        assert polling > 0.1, f"the worker used {polling:.2f} s of CPU in its first 0.3 s of busy polling"
        assert idle < 0.15, f"the daemon used {idle:.2f} s of CPU in 1 s with nothing to do"
