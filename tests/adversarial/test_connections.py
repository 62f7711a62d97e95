"""A connection flood against a daemon with few file descriptors: idle raw connections to the ipc://
socket, and raw TCP connections that never start the CURVE handshake. The daemon must stay up, keep
serving a session connected before the flood, refuse new connections while at ``max_connections``
instead of running out of descriptors (libzmq aborts then), and take new clients again afterwards.
Each test runs a real daemon process with an open-file limit of 256."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cuctxd import Client
from tests.helpers import (
    DaemonProcess,
    cuctx,
    make_key_files,
    pattern,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    tcp_endpoint,
    wait_until,
)

OPEN_FILES = 512
#: What connection_cap leaves at 256 open files: a quarter kept for the daemon, at least 128.
CAP = 128
FLOOD = 1100
#: The daemon's resident memory may not pass this during or after a flood (a sim daemon starts near 60 MiB).
RSS_CEILING = 256 << 20
#: A bystander's op must be answered within this while the flood is on.
SERVED_WITHIN = 3.0
#: Once the flood is gone (closed, or dropped by the handshake timeout), a new client gets in within this.
RECOVERS_WITHIN = 10.0


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(autouse=True)
def attacker_files() -> Iterator[None]:
    """The flood needs more descriptors than the usual soft limit of 1024 (soft only: restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FLOOD + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the open-file hard limit {hard} is below the {want} this flood needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@dataclass
class Bystander:
    """A session connected before the attack, holding a buffer whose bytes must survive it."""

    client: Client
    buffer: Any
    data: bytes

    @classmethod
    def connect(cls, endpoint: str, **keys: Path) -> Bystander:
        """Connect; the client is closed after the test, whatever happens (:func:`close_bystanders`)."""
        client = Client(endpoint, timeout=10, **keys)
        _OPENED.append(client)
        data = pattern(64 << 10, seed=14)
        buffer = client.alloc(len(data))
        client.write(buffer, data)
        return cls(client, buffer, data)

    def served(self) -> float:
        """Read the buffer back and ping; asserts the bytes and returns the seconds it took."""
        started = time.monotonic()
        assert self.client.read(self.buffer) == self.data
        self.client.ping()
        took = time.monotonic() - started
        assert took < SERVED_WITHIN, f"a bystander's ops took {took:.2f} s during the flood"
        return took


_OPENED: list[Client] = []


@pytest.fixture(autouse=True)
def close_bystanders() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def connections(client: Client) -> dict[str, object]:
    return client.status()["connections"]


def wait_refusing(client: Client, timeout: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = connections(client)
        if not seen["accepting"]:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"the daemon never reached max_connections: {seen}")


def flood(family: int, address: object, count: int) -> tuple[list[socket.socket], dict[int, int]]:
    """``count`` non-blocking connects that never send a byte; the sockets and the errors seen, by errno."""
    sockets, errors = [], {}
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sockets.append(sock)
        try:
            sock.connect(address)
        except BlockingIOError as exc:  # EINPROGRESS (tcp) or EAGAIN (a full ipc backlog)
            errors[exc.errno] = errors.get(exc.errno, 0) + 1
        except OSError as exc:
            errors[exc.errno] = errors.get(exc.errno, 0) + 1
    return sockets, errors


def flood_until_refused(family: int, address: object, client: Client, batch: int,
                        pause: float) -> tuple[list[socket.socket], dict[int, int]]:
    """Connect in batches of about the daemon's listen backlog, ``pause`` s apart, as an attacker retrying
    would, until the daemon says it refuses (or :data:`FLOOD` sockets are used), then one batch more,
    which meets the paused listener. A single burst mostly meets a full kernel backlog instead (EAGAIN
    on ipc://; on tcp:// dropped SYNs, retried a second later, by when the handshake timeout has
    closed the connections accepted first), so it may never hold the cap's worth at once."""
    sockets: list[socket.socket] = []
    errors: dict[int, int] = {}
    refusing = False
    while len(sockets) + batch <= FLOOD:
        more, more_errors = flood(family, address, batch)
        sockets += more
        for number, count in more_errors.items():
            errors[number] = errors.get(number, 0) + count
        if refusing:
            break
        time.sleep(pause)
        refusing = connections(client)["accepting"] is False
    return sockets, errors


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def alive(process: DaemonProcess) -> None:
    assert process.process.poll() is None, f"the daemon died:\n{process.log()}"


def connect_within(endpoint: str, timeout: float, **keys: Path) -> float:
    """Seconds until a new client's hello and ping are answered (each try waits at most 1 s)."""
    started = time.monotonic()
    while True:
        try:
            with Client(endpoint, timeout=1.0, heartbeat=False, **keys) as client:
                client.ping()
            return time.monotonic() - started
        except Exception:
            if time.monotonic() - started > timeout:
                raise


@pytest.fixture
def ipc_daemon() -> Iterator[DaemonProcess]:
    # A long handshake timeout: here only the flood closing its connections may free the cap.
    process = start_daemon("--sim-devices", "1", "--sim-memory", "64MiB", "--handshake-timeout", "60",
                           "--max-connections", str(CAP), open_files=OPEN_FILES)
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, process.log()


@pytest.mark.parametrize("target", ["main", "device 0"])
def test_an_ipc_flood_is_refused_at_the_cap_and_the_daemon_recovers(ipc_daemon: DaemonProcess, target: str) -> None:
    """Flooding the main socket or a device's own: every socket counts against one cap, and pauses."""
    process = ipc_daemon
    pid = process.process.pid
    bystander = Bystander.connect(process.endpoint)
    path = str(process.socket_path) if target == "main" else f"{process.socket_path}-dev0"
    sockets, errors = flood_until_refused(socket.AF_UNIX, path, bystander.client, 100, 0.05)
    try:
        seen = wait_refusing(bystander.client)
        alive(process)
        assert seen["max"] == CAP and CAP <= seen["open"] < OPEN_FILES - 32, seen
        assert errors.get(errno.ENOENT, 0) + errors.get(errno.ECONNREFUSED, 0) > 0, errors
        for _ in range(3):
            bystander.served()
        started = time.monotonic()
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late.settimeout(2.0)
        with late, pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            late.connect(path)
        assert time.monotonic() - started < 1.0, "a new connection is refused at once, not left hanging"
        assert rss(pid) < RSS_CEILING
    finally:
        close_all(sockets)
    took = connect_within(process.endpoint, RECOVERS_WITHIN)
    assert took < RECOVERS_WITHIN
    bystander.served()
    assert connections(bystander.client)["accepting"] is True
    assert rss(pid) < RSS_CEILING
    alive(process)
    log = process.log()
    assert log.count("max_connections reached") == 1 and "Too many open files" not in log


@pytest.fixture
def curve_daemon() -> Iterator[tuple[DaemonProcess, str, dict[str, Path]]]:
    root = short_tempdir()
    keys = make_key_files(root)
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--server-key", str(keys.server_secret),
                           "--allow-dir", str(keys.allow_dir), "--sim-devices", "1", "--sim-memory", "64MiB",
                           "--handshake-timeout", "1", "--max-connections", str(CAP), open_files=OPEN_FILES)
    yield process, tcp_endpoint(process), keys.client()
    code = process.stop()
    remove_tempdir(process.socket_dir)
    remove_tempdir(root)
    assert code == 0, process.log()


def test_a_tcp_flood_that_never_handshakes_does_not_lock_out_curve_clients(
        curve_daemon: tuple[DaemonProcess, str, dict[str, Path]]) -> None:
    process, endpoint, keys = curve_daemon
    pid = process.process.pid
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    bystander = Bystander.connect(endpoint, **keys)
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    sockets, _ = flood_until_refused(socket.AF_INET, (host, int(port)), bystander.client, 16, 0.02)
    try:
        seen = wait_refusing(bystander.client)
        alive(process)
        assert seen["max"] == CAP and CAP <= seen["open"] < OPEN_FILES - 32, seen
        bystander.served()
        took = connect_within(endpoint, RECOVERS_WITHIN, **keys)
        assert took < RECOVERS_WITHIN
        bystander.served()
        assert rss(pid) < RSS_CEILING
    finally:
        close_all(sockets)
    wall = time.monotonic() - started
    cpu = cpu_seconds(pid) - cpu_before
    assert cpu < 0.5 * wall + 1.0, f"the daemon used {cpu:.2f} s of CPU in {wall:.2f} s of flood (spinning?)"
    alive(process)
    assert "Too many open files" not in process.log()


def test_status_reports_connections_and_the_cap(ipc_daemon: DaemonProcess) -> None:
    with Client(ipc_daemon.endpoint, timeout=10) as client:
        before = connections(client)
        assert before["max"] == CAP and before["accepting"] is True and before["open"] >= 1, before
        with contextlib.ExitStack() as stack:
            for _ in range(5):
                sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                sock.connect(str(ipc_daemon.socket_path))
            assert wait_until(lambda: connections(client)["open"] >= before["open"] + 5, 5.0)
            during = connections(client)
            assert during["max"] == CAP and during["accepting"] is True
        assert wait_until(lambda: connections(client)["open"] <= during["open"] - 5, 5.0)
        shown = cuctx("--endpoint", ipc_daemon.endpoint, "status")
        assert shown.returncode == 0, shown.stderr
        line = re.search(rf"^connections: (\d+) of {CAP}$", shown.stdout, re.MULTILINE)
        assert line is not None and int(line.group(1)) >= 1, shown.stdout
        assert rss(ipc_daemon.process.pid) < RSS_CEILING
