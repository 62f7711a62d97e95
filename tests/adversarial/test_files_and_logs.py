"""A hostile local user against the daemon's files and log: planted links, foreign directories, the
files a killed daemon could leave, control characters in client-supplied names. Each runs a real daemon process."""

from __future__ import annotations

import grp
import os
import re
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from cuctxd import Client
from tests.adversarial.attacks import Bystander
from tests.helpers import DaemonProcess, cuctxd, remove_tempdir, short_tempdir, start_daemon, wait_for_log


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
    assert "not a plain directory" in done.stderr and "Traceback" not in done.stderr
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
