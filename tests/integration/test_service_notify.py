"""systemd's notify protocol, with a Unix datagram socket standing in for systemd."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cuctxd.client import Client
from tests.helpers import REPO, client_env, remove_tempdir, short_tempdir


@dataclass
class FakeSystemd:
    """The receiving end of ``$NOTIFY_SOCKET``."""

    socket: socket.socket
    address: str  # as NOTIFY_SOCKET spells it

    def messages(self, timeout: float) -> Iterator[dict[str, str]]:
        """Each datagram as a dict of its ``KEY=value`` lines, until ``timeout`` s pass without one."""
        self.socket.settimeout(timeout)
        while True:
            try:
                data = self.socket.recv(4096)
            except TimeoutError:
                return
            yield dict(line.split("=", 1) for line in data.decode().splitlines())

    def wait_for(self, key: str, timeout: float = 20.0) -> tuple[dict[str, str], list[dict[str, str]]]:
        """The first message with ``key`` and the ones before it; AssertionError if none comes."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, str]] = []
        while (left := deadline - time.monotonic()) > 0:
            for message in self.messages(left):
                if key in message:
                    return message, seen
                seen.append(message)
            break
        raise AssertionError(f"no {key} from cuctxd within {timeout} s; got {seen}")


@pytest.fixture
def workdir() -> Iterator[Path]:
    directory = short_tempdir()
    yield directory
    remove_tempdir(directory)


@pytest.fixture
def systemd(workdir: Path) -> Iterator[FakeSystemd]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(workdir / "notify")
    sock.bind(path)
    yield FakeSystemd(sock, path)
    sock.close()


@pytest.fixture
def abstract_systemd() -> Iterator[FakeSystemd]:
    """A socket in Linux's abstract namespace, which NOTIFY_SOCKET spells with a leading '@'."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"cuctxd-test-{secrets.token_hex(6)}"
    sock.bind("\0" + name)
    yield FakeSystemd(sock, "@" + name)
    sock.close()


def start(workdir: Path, systemd: FakeSystemd, *extra: str, **env: str) -> tuple[subprocess.Popen[str], str]:
    endpoint = f"ipc://{workdir}/d.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "cuctxd.daemon", "--backend", "sim", "--endpoint", endpoint, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(client_env(), NOTIFY_SOCKET=systemd.address, **env),
    )
    return process, endpoint


def finish(process: subprocess.Popen[str], *, signalled: bool = False) -> tuple[int, str]:
    """SIGTERM (unless ``signalled`` already: a second one would skip the drain) and wait for the exit."""
    if process.poll() is None and not signalled:
        process.terminate()
    _, err = process.communicate(timeout=20)
    return process.returncode, err


def test_ready_comes_once_the_daemon_answers(workdir: Path, systemd: FakeSystemd) -> None:
    process, endpoint = start(workdir, systemd, "--log-level", "DEBUG")
    try:
        ready, before = systemd.wait_for("READY")
        assert ready["READY"] == "1"
        assert ready["MAINPID"] == str(process.pid)
        assert "serving 2 sim device(s)" in ready["STATUS"]
        assert before == []
        with Client(endpoint, timeout=2) as client:  # at once, no retry: it is ready
            assert client.ping() > 0
    finally:
        code, err = finish(process)
    assert code == 0, err
    # the probe's ping went through the front (the front logs it), and READY=1 waited for its answer
    assert "request 1 (ping): ok" in err, err
    assert err.index("the front answered the first liveness ping") < err.index("READY=1 sent"), err


def test_an_abstract_notify_socket_works(workdir: Path, abstract_systemd: FakeSystemd) -> None:
    process, _ = start(workdir, abstract_systemd)
    try:
        ready, _ = abstract_systemd.wait_for("READY")
        assert ready["READY"] == "1"
    finally:
        code, err = finish(process)
    assert code == 0, err


def test_watchdog_pings_come_at_half_the_interval(workdir: Path, systemd: FakeSystemd) -> None:
    process, _ = start(workdir, systemd, WATCHDOG_USEC="200000")
    try:
        systemd.wait_for("READY")
        started = time.monotonic()
        pings = 0
        while pings < 5:
            systemd.wait_for("WATCHDOG", timeout=2)
            pings += 1
        elapsed = time.monotonic() - started
        assert 0.25 < elapsed < 2.0, elapsed  # about every 0.1 s
    finally:
        code, err = finish(process)
    assert code == 0, err


def test_no_watchdog_pings_for_another_pid(workdir: Path, systemd: FakeSystemd) -> None:
    process, _ = start(workdir, systemd, WATCHDOG_USEC="200000", WATCHDOG_PID=str(os.getpid()))
    try:
        systemd.wait_for("READY")
        assert not [m for m in systemd.messages(0.5) if "WATCHDOG" in m]
    finally:
        code, err = finish(process)
    assert code == 0, err


def test_stopping_is_sent_on_sigterm(workdir: Path, systemd: FakeSystemd) -> None:
    process, _ = start(workdir, systemd)
    signalled = False
    try:
        systemd.wait_for("READY")
        process.send_signal(signal.SIGTERM)
        signalled = True
        stopping, _ = systemd.wait_for("STOPPING")
        assert stopping["STOPPING"] == "1"
        assert stopping["STATUS"].startswith("draining")
    finally:
        code, err = finish(process, signalled=signalled)
    assert code == 0, err


def test_without_notify_socket_nothing_is_sent(workdir: Path, systemd: FakeSystemd) -> None:
    endpoint = f"ipc://{workdir}/d.sock"
    env = {k: v for k, v in client_env().items() if k != "NOTIFY_SOCKET"}
    process = subprocess.Popen([sys.executable, "-m", "cuctxd.daemon", "--backend", "sim", "--endpoint", endpoint],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert process.stdout is not None
        assert "listening on" in process.stdout.readline()
        assert list(systemd.messages(0.3)) == []
    finally:
        code, err = finish(process)
    assert code == 0, err
