"""DaemonWatch (client/wire/transport.py) against real listeners: processes that listen on a Unix socket file,
killed and replaced on the same path as a daemon is, and tcp ports nobody listens on. The ``ping`` half of
the watch needs a daemon: tests/reliability/test_calls_across_a_restart.py covers it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuctxd.client.wire.transport import DaemonWatch
from cuctxd.protos.errors import DaemonRestarted, NoDaemon
from tests.helpers import remove_tempdir, short_tempdir

#: A stand-in daemon: listens on the socket file ``argv[1]`` (a stale one removed first) until killed.
LISTENER = """
import os, socket, sys
if os.path.exists(sys.argv[1]):
    os.unlink(sys.argv[1])
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen()
print("ready", flush=True)
sys.stdin.read()
"""


class Listeners:
    """Listener processes on one socket path, one after another."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.endpoint = f"ipc://{path}"
        self.processes: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        process = subprocess.Popen([sys.executable, "-c", LISTENER, str(self.path)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        self.processes.append(process)
        assert process.stdout is not None and process.stdout.readline() == "ready\n"

    def kill(self) -> None:
        """SIGKILL the newest (its socket file stays, refusing connections)."""
        process = self.processes[-1]
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()


@pytest.fixture
def listeners() -> Iterator[Listeners]:
    directory = short_tempdir()
    made = Listeners(directory / "d.sock")
    try:
        yield made
    finally:
        made.close()
        remove_tempdir(directory)


def test_a_killed_listener_replaced_on_its_path_is_a_restart_whatever_the_inode(listeners: Listeners) -> None:
    listeners.start()
    watch = DaemonWatch.seen(listeners.endpoint)
    try:
        watch.expect("first")
        assert watch.probes and watch.check("status") is None
        listeners.kill()
        listeners.start()
        gone = watch.check("status")
        assert isinstance(gone, DaemonRestarted) and gone.op == "status", repr(gone)
        again = watch.check("read")  # found once, for every transport of the session
        assert isinstance(again, DaemonRestarted) and again.op == "read"
    finally:
        watch.close()


def test_a_killed_listener_with_nobody_after_it_is_no_daemon(listeners: Listeners) -> None:
    listeners.start()
    watch = DaemonWatch.seen(listeners.endpoint)
    try:
        watch.expect("first")
        listeners.kill()
        gone = watch.check("lookup")
        assert type(gone) is NoDaemon and gone.op == "lookup", repr(gone)
        assert isinstance(watch.exited("read"), NoDaemon)
    finally:
        watch.close()


def test_a_pidfd_whose_process_exited_before_hello_answered_is_not_kept(listeners: Listeners) -> None:
    """The pidfd is taken before ``hello``; a daemon replaced meanwhile answered it, so that pidfd names
    another daemon than the session's: dropped, and the new listener is not taken for a restart."""
    listeners.start()
    watch = DaemonWatch.seen(listeners.endpoint)
    try:
        listeners.kill()
        listeners.start()
        watch.expect("second")
        assert watch.check("status") is None  # someone listens; without a ping to ask, it cannot be told
    finally:
        watch.close()


def test_a_tcp_port_that_refuses_connections_is_no_daemon() -> None:
    with socket.socket() as bound:  # bound and not listening: the port refuses connections
        bound.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{bound.getsockname()[1]}"
        gone = DaemonWatch(endpoint).check("status")
        assert type(gone) is NoDaemon, repr(gone)
        bound.listen()
        assert DaemonWatch(endpoint).check("status") is None
