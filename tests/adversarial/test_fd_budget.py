"""Running the daemon out of file descriptors, and denying the fd channel to everyone (issue 25, items 3
and 6), against a real daemon with an open-file limit of 1024.

Item 3: sessions that take every ``host_alloc`` ticket they can and redeem none used to run a daemon at
``ulimit -n 1024`` out of fds, and libzmq then aborted it on the next connection. Now every fd held for a
client counts in one budget cut from the open-file limit, with per-peer and per-session shares: the
hoarders get ``CUCTXD_ERROR_LIMIT_EXCEEDED`` naming the share, another peer still gets tickets, new
connections are taken, the bystander is served and the daemon lives.

Item 6: one process that holds every fd channel connection it can open used to leave new data-plane
clients with ``ConnectionLost``; now it is refused beyond its own share and everyone else is served.
Each attacker is a process of its own (a peer), started from ``tests.helpers.client_processes``; its targets live in
:mod:`tests.adversarial.fd_attackers`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

import pytest

from cuctxd import Client
from cuctxd.client.wire import build
from tests.adversarial.attacks import Bystander, assert_alive, open_bystander
from tests.adversarial.fd_attackers import data_plane_clients, hoard_tickets, hold_fd_connections
from tests.helpers import DaemonProcess, client_processes, running_daemon, wait_until

#: The daemon's RLIMIT_NOFILE (soft and hard: it cannot raise it), as in the report.
OPEN_FILES = 1024
#: What the plan makes of it (PROTOCOL.md, "File descriptors"): fds held for clients, per peer, per session.
CLIENT_FDS, PER_PEER, PER_SESSION = 384, 96, 48
#: Each unredeemed host_alloc holds two fds in the daemon: its ticket's and the buffer's mapping's.
FDS_PER_HOST_ALLOC = 2
#: Seconds an attacker process may take to start, attack and report.
REPORT_WITHIN = 40.0

forkserver = client_processes()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--sim-devices", "2", "--sim-memory", "256MiB", open_files=OPEN_FILES,
                        clean_log=True) as process:
        yield process
        assert_alive(process)
    assert "Too many open files" not in process.log(), process.log()[-5000:]


@pytest.fixture
def bystander(daemon: DaemonProcess) -> Iterator[Bystander]:
    with open_bystander(daemon.endpoint) as innocent:
        yield innocent
        assert_alive(daemon)
        innocent.check()


@contextmanager
def attackers(target: Any, *args_per_process: tuple[Any, ...]) -> Iterator[list[Any]]:
    """Start one process per ``args`` running ``target(*args, pipe)``; yield their first reports while they
    hold what they took (:func:`ask` gets more); on the way out tell them to let go and wait for them."""
    with ExitStack() as stack:
        pipes: list[Connection] = []
        processes = []
        for args in args_per_process:
            mine, theirs = forkserver.Pipe()
            process = forkserver.Process(target=target, args=(*args, theirs), daemon=True)
            process.start()
            theirs.close()
            pipes.append(mine)
            processes.append(process)

            def finish(pipe: Connection = mine, child: Any = process) -> None:
                with suppress(OSError):
                    pipe.send("let go")
                pipe.close()
                child.join(20)
                if child.is_alive():
                    child.kill()
                    child.join()

            stack.callback(finish)
        reports = []
        for pipe, process in zip(pipes, processes, strict=True):
            assert pipe.poll(REPORT_WITHIN), f"an attacker (pid {process.pid}) did not report in time"
            reports.append(pipe.recv())
            _PIPES[id(reports[-1])] = pipe
        try:
            yield reports
        finally:
            _PIPES.clear()


_PIPES: dict[int, Connection] = {}


def ask(report: object) -> Any:
    """The next report of the attacker whose first report was ``report``."""
    pipe = _PIPES[id(report)]
    pipe.send("go on")
    assert pipe.poll(REPORT_WITHIN), "the attacker did not report in time"
    return pipe.recv()


def budget(client: Client) -> dict[str, Any]:
    status: dict[str, Any] = client.status()["fd_budget"]
    return status


def daemon_fds(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def test_ticket_hoarders_get_limit_exceeded_and_everyone_else_is_served(daemon: DaemonProcess,
                                                                        bystander: Bystander) -> None:
    with Client(daemon.endpoint, timeout=10, name="observer") as observer:
        plan = budget(observer)
        assert (plan["open_files"], plan["max"], plan["max_per_peer"], plan["max_per_session"]) == (
            OPEN_FILES, CLIENT_FDS, PER_PEER, PER_SESSION)
        # One process, 8 sessions: the first sessions fill their shares, then the process is at its own.
        with attackers(hoard_tickets, (daemon.endpoint, 8)) as [report]:
            taken = [tickets for tickets, _ in report]
            refusals = [message for _, message in report]
            assert all(message is not None for message in refusals), report
            assert refusals[0].startswith("max_client_fds_per_session:"), report
            assert any(message.startswith("max_client_fds_per_peer:") for message in refusals), report
            assert sum(taken) * FDS_PER_HOST_ALLOC <= PER_PEER and max(taken) * FDS_PER_HOST_ALLOC <= PER_SESSION
            assert max(entry["held"] for entry in budget(observer)["top_peers"]) <= PER_PEER
            # another peer still gets tickets, raw and through the whole data plane
            assert observer.run(build.host_alloc(0, 4096))["ticket"]
            observer.host_alloc(4096).free()
            bystander.check()
            # four more processes, 8 sessions each: now the daemon-wide budget runs out, not the fds
            more = [(daemon.endpoint, 8)] * 4
            with attackers(hoard_tickets, *more) as reports:
                messages = [message for report in reports for _, message in report]
                assert any(message is not None and message.startswith("max_client_fds:") for message in messages)
                assert budget(observer)["held"] <= CLIENT_FDS
                assert daemon_fds(daemon) < OPEN_FILES - 64
                assert_alive(daemon)
                bystander.check()
                with Client(daemon.endpoint, timeout=10, name="latecomer") as latecomer:  # new connections
                    data = os.urandom(64 << 10)
                    buffer = latecomer.alloc(len(data))
                    latecomer.write(buffer, data)  # the staging ring may be refused: the socket carries it
                    assert latecomer.read(buffer) == data
        mine = [f"process:{os.getpid()}"]  # the attackers' fds are all given back once they are gone
        assert wait_until(lambda: [p["peer"] for p in budget(observer)["top_peers"]] == mine, timeout=10), \
            budget(observer)
    assert "max_connections reached" not in daemon.log()


def test_one_peer_holding_fd_channel_connections_denies_no_one_else(daemon: DaemonProcess,
                                                                   bystander: Bystander) -> None:
    path = daemon.endpoint[len("ipc://"):] + ".fds"
    with Client(daemon.endpoint, timeout=10, name="observer") as observer:
        per_peer = observer.status()["fd_channel"]["max_connections_per_peer"]
        with attackers(hold_fd_connections, (path, 300)) as [connected]:
            assert connected == 300
            assert wait_until(lambda: observer.status()["fd_channel"]["refused"] >= 300 - per_peer, timeout=10)
            kept, refusal = ask(connected)
            assert kept == per_peer, (kept, refusal)
            assert refusal is not None and refusal.startswith(
                "CUCTXD_ERROR_LIMIT_EXCEEDED: max_fd_connections_per_peer:"), refusal
            channel = observer.status()["fd_channel"]
            assert channel["connections"] >= per_peer and channel["refused"] >= 300 - per_peer
            assert budget(observer)["held"] >= per_peer  # the connections count in the fd budget
            # 24 fresh data-plane clients in 3 other processes, while the attacker holds its connections
            with attackers(data_plane_clients, *[(daemon.endpoint, 8)] * 3) as reports:
                assert reports == [[], [], []]
            bystander.check()
            assert_alive(daemon)
    assert "fd channel: refusing new connections: max_fd_connections_per_peer:" in daemon.log()
