"""The connection cap's arithmetic, the budget's hysteresis, and pausing real listening sockets."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from cuctxd.daemon.intake.connections import (
    ConnectionWatch,
    ListenerGuard,
    connection_cap,
    fd_reserve,
    listen_backlog,
)
from cuctxd.daemon.intake.listeners import IpcListener, TcpListener
from cuctxd.daemon.registry.connection_budget import ConnectionBudget
from tests.helpers import remove_tempdir, short_tempdir, wait_until


@pytest.mark.parametrize(("files", "cap"), [(256, 64), (1024, 384), (100, 25), (1 << 20, 393216)])
def test_the_default_cap_is_half_of_what_the_reserve_leaves(files: int, cap: int) -> None:
    assert connection_cap(files, 0) == cap == (files - fd_reserve(files)) // 2


def test_the_listen_backlog_fits_in_the_reserve() -> None:
    assert [listen_backlog(files) for files in (64, 256, 1024, 1 << 20)] == [8, 16, 32, 100]


def test_a_configured_cap_is_kept_unless_the_open_file_limit_forbids_it() -> None:
    assert connection_cap(1024, 100) == 100
    assert connection_cap(1024, 5000) == 576  # three quarters of the 768 the reserve leaves: fds for clients stay


def test_the_budget_refuses_at_the_cap_and_accepts_again_at_the_low_water_mark() -> None:
    budget = ConnectionBudget(20)
    assert budget.low_water == 18
    budget.change(19)
    assert not budget.refusing
    budget.change(1)
    assert budget.refusing and budget.to_status() == {"open": 20, "max": 20, "accepting": False}
    budget.change(-1)
    assert budget.refusing, "hysteresis: one connection gone is not enough"
    budget.change(-1)
    assert not budget.refusing
    budget.change(-100)
    assert budget.count == 0


@pytest.fixture
def directory() -> Iterator[Path]:
    path = short_tempdir()
    yield path
    remove_tempdir(path)


def test_a_paused_ipc_listener_refuses_new_connections_and_keeps_old_ones(directory: Path) -> None:
    path = directory / "d.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o600)
        server.listen(8)
        kept = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        kept.connect(str(path))
        accepted, _ = server.accept()
        listener = IpcListener(path)
        listener.pause()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late, pytest.raises(FileNotFoundError):
            late.connect(str(path))
        kept.sendall(b"x")
        assert accepted.recv(1) == b"x"
        listener.resume()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert os.listdir(directory) == ["d.sock"], "the private directory it was moved to is gone"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again:
            again.connect(str(path))
        kept.close()
        accepted.close()


def test_an_ipc_listener_never_resumes_over_a_file_put_in_its_place(directory: Path) -> None:
    path = directory / "d.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        listener = IpcListener(path)
        listener.pause()
        path.write_text("squatter")
        with pytest.raises(FileExistsError):
            listener.resume()
        assert path.read_text() == "squatter"
        listener.close()
        assert os.listdir(directory) == ["d.sock"]


def test_a_paused_tcp_listener_leaves_new_connections_unanswered() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        address = server.getsockname()
        listener = TcpListener(server.fileno())
        listener.pause()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as late:
            late.settimeout(0.3)
            with pytest.raises((TimeoutError, socket.timeout)):
                late.connect(address)
        listener.resume()
        with socket.create_connection(address, timeout=2):
            pass


def test_the_watch_pauses_at_the_cap_and_a_failed_watch_resumes(directory: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A real ROUTER: its first connection reaches a cap of 1 and the watch thread moves the socket file
    aside; when the watch then fails, it puts the file back rather than shut new clients out for good."""
    path = directory / "d.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    budget = ConnectionBudget(1)
    watch = ConnectionWatch()
    guard = ListenerGuard(router, budget)
    watch.add(guard)
    router.bind(f"ipc://{path}")
    guard.watch([f"ipc://{path}"])
    watch.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(path))
        assert wait_until(lambda: not path.exists(), 5.0), "the listener was not paused at the cap"

        def broken() -> None:
            raise RuntimeError("monitor went wrong")

        guard.take_events = broken  # type: ignore[method-assign]
        client.close()  # an event for the broken watch to meet
        assert wait_until(path.exists, 5.0), "a failed watch left the listener paused"
        assert "connection watch thread failed" in caplog.text
    finally:
        client.close()
        watch.stop()
        router.close()
        context.term()
