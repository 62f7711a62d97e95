"""A hostile local user against the daemon's files and log: planted links, foreign directories, the
files a killed daemon could leave, control characters in client-supplied names. Each runs a real daemon process."""

from __future__ import annotations

import contextlib
import grp
import os
import re
import signal
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from cuctxd import Client
from cuctxd.daemon.intake.observe import WARN_BURST
from tests.adversarial.attacks import Bystander
from tests.helpers import (
    DaemonProcess,
    cuctxd,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    wait_for_log,
    wait_until,
)
from tests.helpers_raw import error_name, raw_peer


@pytest.fixture
def workdir() -> Path:
    path = short_tempdir()
    yield path
    remove_tempdir(path)


def test_a_symlinked_socket_directory_is_refused_and_its_target_untouched(workdir: Path) -> None:
    target = workdir / "target"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    (workdir / "planted").symlink_to(target)
    done = cuctxd("--backend", "sim", "--endpoint", f"ipc://{workdir}/planted/d.sock")
    assert done.returncode != 0
    assert "is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert list(target.iterdir()) == []


def test_an_existing_directory_keeps_its_mode_and_group(workdir: Path) -> None:
    workdir.chmod(0o751)
    group = grp.getgrgid(os.getgid()).gr_name
    process = start_daemon("--group", group, endpoint=f"ipc://{workdir}/d.sock")
    try:
        with Client(process.endpoint, timeout=10) as client:
            assert client.ping() > 0
        assert stat.S_IMODE(workdir.stat().st_mode) == 0o751
        assert stat.S_IMODE(process.socket_path.stat().st_mode) == 0o660
        fd_channel = process.socket_path.with_name(process.socket_path.name + ".fds")
        assert stat.S_IMODE(fd_channel.stat().st_mode) == 0o660, "the fd channel is as open as its endpoint"
    finally:
        assert process.stop() == 0, process.log()


def test_something_else_at_the_socket_path_is_not_replaced(workdir: Path) -> None:
    squatter = workdir / "d.sock"
    squatter.write_text("not a socket")
    done = cuctxd("--backend", "sim", "--endpoint", f"ipc://{squatter}")
    assert done.returncode != 0 and "is not a socket" in done.stderr
    assert squatter.read_text() == "not a socket"


def _shared_memory_files() -> set[str]:
    """Names under /dev/shm (and the temp directory) that a sim daemon could have made."""
    names: set[str] = set()
    for directory in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        if directory.is_dir():
            names |= {entry.name for entry in directory.iterdir() if entry.name.startswith("cuctxd-sim")}
    return names


def test_a_killed_daemon_leaves_no_shared_memory_files_and_its_socket_is_swept(workdir: Path) -> None:
    before = _shared_memory_files()
    endpoint = f"ipc://{workdir}/d.sock"
    killed = start_daemon(endpoint=endpoint)
    with Client(endpoint, timeout=10, heartbeat=False) as client:
        pooled = client.alloc(4096, device=0, shareable=True)
        client.publish(pooled, "left-behind")
        with client.open_shared("left-behind") as opened:  # the pool's memfd came over the fd channel
            opened.host_view()[:4] = b"seen"
        host = client.host_alloc(8192)
        assert _shared_memory_files() == before, "sharing made files"
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
        host.close()
    killed.close_pipes()
    assert _shared_memory_files() == before
    assert killed.socket_path.exists()
    restarted = start_daemon(endpoint=endpoint)
    try:
        wait_for_log(restarted, f"removed the stale socket {re.escape(str(killed.socket_path))}")
        with Client(endpoint, timeout=10) as client:
            assert client.ping() > 0
    finally:
        assert restarted.stop() == 0, restarted.log()


def _paused(directory: Path) -> list[Path]:
    return sorted(directory.glob(".paused-*"))


def test_a_daemon_killed_while_refusing_connections_leaves_nothing_after_its_restart(workdir: Path) -> None:
    endpoint = f"ipc://{workdir}/d.sock"
    killed = start_daemon("--max-connections", "8", endpoint=endpoint)
    lane_socket = workdir / "d.sock-dev0"
    with contextlib.ExitStack() as stack:
        for _ in range(8):  # idle connections to the main socket: the cap is reached, every listener pauses
            sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            sock.connect(str(killed.socket_path))
        wait_for_log(killed, "max_connections reached")
        assert wait_until(lambda: not killed.socket_path.exists() and not lane_socket.exists(), timeout=5)
        parked = _paused(workdir)
        assert len(parked) >= 2, "the main socket and each device's are moved aside"
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
    killed.close_pipes()
    assert _paused(workdir) == parked
    foreign = workdir / ".paused-keepme00"  # not one of this daemon's: another endpoint's, left alone
    foreign.mkdir(mode=0o700)
    (foreign / "other.sock").write_bytes(b"")
    restarted = start_daemon(endpoint=endpoint)
    try:
        wait_for_log(restarted, f"removed {re.escape(str(parked[0]))}, left by a daemon killed while")
        assert _paused(workdir) == [foreign]
        with Client(endpoint, timeout=10) as client:
            assert client.ping() > 0
    finally:
        assert restarted.stop() == 0, restarted.log()
    assert sorted(workdir.iterdir()) == [foreign], "a clean stop leaves only what was not the daemon's"


def test_a_second_daemon_will_not_start_on_an_endpoint_whose_daemon_is_paused(workdir: Path) -> None:
    endpoint = f"ipc://{workdir}/d.sock"
    live = start_daemon("--max-connections", "4", endpoint=endpoint)
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(4):
                sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                sock.connect(str(live.socket_path))
            wait_for_log(live, "max_connections reached")
            assert wait_until(lambda: not live.socket_path.exists(), timeout=5)
            done = cuctxd("--backend", "sim", "--endpoint", endpoint)
            assert done.returncode != 0 and "paused at max_connections" in done.stderr, done.stderr
            assert len(_paused(workdir)) >= 2, "the live daemon's moved-aside sockets stay"
        assert wait_until(live.socket_path.exists, timeout=5), "the live daemon takes connections again"
        with Client(endpoint, timeout=10) as client:
            assert client.ping() > 0
    finally:
        assert live.stop() == 0, live.log()
    assert _paused(workdir) == []


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    """Text log lines at INFO: what the log-forging test reads."""
    return ("--log-level", "INFO", "--log-format", "text")


def test_control_characters_in_a_client_name_cannot_forge_log_lines(attack_daemon: DaemonProcess,
                                                                    bystander: Bystander) -> None:
    forged = "2026-01-01 00:00:00,000 INFO cuctxd.daemon.sessions [MainThread] session 0 closed by root"
    with Client(attack_daemon.endpoint, timeout=10, name=f"evil\n{forged}\x1b[2J\r") as client:
        assert client.ping() > 0
    bystander.check()
    lines = attack_daemon.log().splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines)
    assert not any("\x1b" in line or "\r" in line for line in lines)
    assert any("evil\\n2026-01-01" in line and "\\x1b[2J\\r" in line for line in lines)


def test_bidi_and_zero_width_characters_reach_the_text_log_escaped(attack_daemon: DaemonProcess,
                                                                     bystander: Bystander) -> None:
    name = "admin\u202etxt.exe\u200b\u2066\ufeff\u00a0end"
    with Client(attack_daemon.endpoint, timeout=10, name=name) as client:
        assert client.ping() > 0
    bystander.check()
    log = attack_daemon.log()
    assert not any(char in log for char in "\u202e\u200b\u2066\ufeff\u00a0")
    assert "admin\\u202etxt.exe\\u200b\\u2066\\ufeff\\xa0end" in log


@pytest.mark.parametrize("name", ["root\x00/x", "evil\x00", "a\nb", "\u202eexe.txt", "ali\u200bce/x", "x\u2028y"])
def test_a_name_with_a_control_or_format_character_is_a_bad_argument(attack_daemon: DaemonProcess,
                                                                      bystander: Bystander, name: str) -> None:
    with raw_peer(attack_daemon.endpoint) as peer:
        token = peer.hello()
        buffer = peer.ok("alloc", {"device": 0, "size": 256}, token)[0]["buffer"]["handle"]
        for op, args in (("publish", {"device": 0, "buffer": buffer, "name": name}), ("lookup", {"name": name}),
                         ("unpublish", {"name": name})):
            header, _ = peer.call(op, args, token)
            assert error_name(header) == "CUCTXD_ERROR_BAD_ARGUMENT", (op, header)
            assert "control or format characters" in header["error"]["message"]
        assert peer.ok("list_shared", None, token)[0]["shared"] == []
        peer.ok("goodbye", None, token)
    bystander.check()
    assert "Traceback" not in attack_daemon.log()


def test_a_flood_of_refused_requests_writes_a_few_log_lines_not_one_each(attack_daemon: DaemonProcess,
                                                                         bystander: Bystander) -> None:
    flood = 3000
    with raw_peer(attack_daemon.endpoint) as peer:
        token = peer.hello()
        for op, args, error in (("lookup", {"name": "missing"}, "CUCTXD_ERROR_NOT_FOUND"),
                                ("free", {"device": 0, "buffer": 12345}, "CUCTXD_ERROR_UNKNOWN_HANDLE")):
            for _ in range(0, flood, 250):
                sent = [peer.send(op, args, token) for _ in range(250)]
                for _ in sent:
                    assert error_name(peer.recv()[0]) == error
            bystander.check()
        peer.ok("goodbye", None, token)
    lines = attack_daemon.log().splitlines()
    for op in ("lookup", "free"):
        one_by_one = [line for line in lines if f"({op}) failed:" in line]
        assert 1 <= len(one_by_one) <= WARN_BURST, f"{len(one_by_one)} lines for {flood} failed {op} requests"
