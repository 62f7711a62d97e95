"""The ``cuctx`` CLI (``python -m cuctxd.client``) and the daemon process's life cycle."""

from __future__ import annotations

import ctypes
import json
import platform
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.client import Client
from cuctxd.daemon import __version__
from tests.helpers import (
    REPO,
    DaemonProcess,
    client_env,
    cuctx,
    cuctxd,
    cuda_driver_loads,
    remove_tempdir,
    short_tempdir,
    start_daemon,
)
from tests.helpers_raw import raw_peer

MiB = 1 << 20
ENV = client_env()


@pytest.fixture(scope="module")
def holder(daemon: DaemonProcess) -> Iterator[Client]:
    """A session holding memory on device 1, for status to show."""
    with Client(daemon.endpoint, timeout=10, name="holder") as client:
        client.set_device(1)
        client.alloc(3 * MiB, device=1)
        yield client


# --- cuctx -------------------------------------------------------------------------------


def test_ping(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "ping")
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"pong from {daemon.endpoint}: ")
    assert re.search(rf": \d+(\.\d)? (µs|ms|s) \(cuctxd {re.escape(__version__)}, backend sim\)$", line), line


def test_ping_count(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "ping", "-c", "3")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3


def test_ping_json(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "ping", "-c", "2")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["endpoint"] == daemon.endpoint
    assert len(out["rtt_s"]) == 2
    assert all(0 < t < 10 for t in out["rtt_s"])


def test_the_endpoint_comes_from_the_environment(daemon: DaemonProcess) -> None:
    done = cuctx("--json", "ping", env=dict(ENV, CUCTXD_ENDPOINT=daemon.endpoint))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["endpoint"] == daemon.endpoint


def test_devices(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "devices")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["DEV", "NAME", "CC", "MEMORY", "USED", "FREE", "CUCTXD", "SMS", "PCI", "BUS", "ID",
                              "UUID"]
    assert len(rows) == 2
    for index, row in enumerate(rows):
        assert row.split()[0] == str(index)
        assert "cuctxd simulated GPU" in row
        assert "9.0" in row
        assert "64 MiB" in row
        assert "GPU-" in row


def test_devices_json(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "devices")
    assert done.returncode == 0, done.stderr
    devices = json.loads(done.stdout)
    assert [d["index"] for d in devices] == [0, 1]
    assert all(d["total_memory"] == 64 * MiB for d in devices)
    assert all(d["compute_capability"] == [9, 0] for d in devices)
    assert len({d["uuid"] for d in devices}) == 2


def test_status(daemon: DaemonProcess, holder: Client) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "status")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert f"cuctxd {__version__} (protocol 1), backend sim, pid {daemon.process.pid}" in text
    assert f"listening on {daemon.endpoint}" in text
    assert "sessions: 2" in text  # the holder and cuctx itself
    assert "holder" in text
    (own,) = [line for line in text.splitlines() if "(this cuctx)" in line]
    assert own.split()[1:4] == ["cuctx", "(this", "cuctx)"]
    assert "(this cuctx)" not in next(line for line in text.splitlines() if "holder" in line)
    assert "device 0 cuctxd simulated GPU: worker cuctxd-device-0" in text
    assert "device 1 cuctxd simulated GPU: worker cuctxd-device-1" in text
    assert "primary context active, 1 reference(s)" in text
    assert "primary context inactive" in text  # device 0: nobody touched it
    assert "3 MiB" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("SESSION") and "OBJECTS" in line)
    row = next(line for line in lines[at:] if line.startswith(f"{holder.session_id} "))
    # each session's use against the per-session limits (the daemon's defaults): CREATED, OBJECTS (one
    # buffer on device 1) and SHARES
    assert re.search(r" 0/64 .* 1/16384 .* 0/1024 +0 B/4 GiB ", row), (lines[at], row)
    assert re.search(r"^fd channel: \d+ of 256 connections, 0 ticket\(s\) waiting \(0 fds\)$", text, re.MULTILINE)
    device_1 = text[text.index("device 1 cuctxd simulated GPU"):]
    assert "shm lanes: 1 open" in device_1 and "shm lanes" not in text[:text.index("device 1 cuctxd")]


def test_status_json(daemon: DaemonProcess, holder: Client) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "status")
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    assert status["backend"] == "sim"
    assert status["pid"] == daemon.process.pid
    clients = sorted(s["client"] for s in status["sessions"])
    assert clients == ["cuctx", "holder"]
    dev1 = status["devices"][1]
    assert dev1["worker"]["name"] == "cuctxd-device-1"
    assert dev1["primary_context"]["active"] is True
    (held,) = [s for s in dev1["sessions"] if s["session"] == holder.session_id]
    assert (held["allocations"], held["bytes"]) == (1, 3 * MiB)


def test_cuctx_leaves_no_session_behind(daemon: DaemonProcess, holder: Client) -> None:
    assert cuctx("--endpoint", daemon.endpoint, "status").returncode == 0
    assert [s["session"] for s in holder.status()["sessions"]] == [holder.session_id]


def test_cuctx_without_a_daemon_exits_1_with_a_message() -> None:
    directory = short_tempdir()
    try:
        endpoint = f"ipc://{directory}/absent.sock"
        done = cuctx("--endpoint", endpoint, "--timeout", "0.5", "ping")
        assert done.returncode == 1
        assert done.stdout == ""
        assert done.stderr.startswith("cuctx: ")
        assert "CUCTXD_NO_DAEMON" in done.stderr
        assert endpoint in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        remove_tempdir(directory)


def test_cuctx_usage_error() -> None:
    done = cuctx("frobnicate")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


@pytest.mark.parametrize("command", ["devices", "status", "shared", "doctor", "ping"])
def test_json_after_the_command(daemon: DaemonProcess, command: str) -> None:
    done = cuctx(command, "--json", "--endpoint", daemon.endpoint)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)


@pytest.mark.parametrize("options", [("--timeout", "1"), ("--timeout", "1", "--json")])
def test_endpoint_and_timeout_after_the_command(daemon: DaemonProcess, options: tuple[str, ...]) -> None:
    done = cuctx("ping", "--endpoint", daemon.endpoint, *options)
    assert done.returncode == 0, done.stderr
    assert daemon.endpoint in done.stdout


def test_an_option_after_the_command_overrides_the_one_before(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", "ipc:///nonexistent/x.sock", "--timeout", "0.2", "ping", "--endpoint",
                 daemon.endpoint, "--timeout", "10")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"pong from {daemon.endpoint}")


def test_version() -> None:
    done = cuctx("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cuctx {__version__}"


def test_help_without_a_command_is_the_general_help() -> None:
    done = cuctx("help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: cuctx ")
    for command in ("ping", "devices", "status", "shared", "doctor"):
        assert command in done.stdout


def test_help_of_one_command() -> None:
    done = cuctx("help", "status")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: cuctx status ")
    assert "--watch" in done.stdout and "--endpoint" in done.stdout


def test_help_of_an_unknown_command_is_one_line_and_exit_2() -> None:
    done = cuctx("help", "frobnicate")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("cuctx: no command 'frobnicate'") and "status" in line


@pytest.mark.parametrize(("endpoint", "says"), [
    ("/tmp/x.sock", "ipc:///tmp/x.sock"),
    ("localhost:5555", "tcp://localhost:5555"),
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("http://127.0.0.1:8080/", "not an ipc:// or tcp:// URL"),
    ("tcp://127.0.0.1:http", "port"),
])
def test_a_malformed_endpoint_is_one_line_and_exit_2(endpoint: str, says: str) -> None:
    done = cuctx("--endpoint", endpoint, "ping")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("cuctx: --endpoint: ") and says in line


@pytest.mark.parametrize("command", [("doctor",), ("status", "--watch", "--count", "1")])
def test_a_malformed_endpoint_stops_every_command(command: tuple[str, ...]) -> None:
    done = cuctx(*command, "--endpoint", "localhost:5555")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_malformed_endpoint_in_the_environment_is_named() -> None:
    done = cuctx("ping", env=dict(ENV, CUCTXD_ENDPOINT="localhost:5555"))
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("cuctx: $CUCTXD_ENDPOINT: ") and "tcp://localhost:5555" in line


# --- the daemon process ----------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_daemon_exits_0_and_removes_its_socket_on_signal(signum: int) -> None:
    process = start_daemon("--sim-devices", "2", "--sim-memory", "16MiB")
    try:
        assert process.socket_path.exists()
        assert oct(process.socket_path.stat().st_mode & 0o777) == oct(0o600)
        with raw_peer(process.endpoint) as peer:  # a session still open when the signal comes
            token = peer.hello()
            handle = peer.ok("alloc", {"size": MiB, "device": 1}, token)[0]["buffer"]["handle"]
            peer.ok("fill", {"buffer": handle, "value": 1, "device": 1}, token)
            peer.ok("create_context", {"device": 0}, token)
            process.process.send_signal(signum)
            assert process.process.wait(20) == 0, process.log()
        assert not process.socket_path.exists()
        assert "Traceback" not in process.log()
    finally:
        process.stop()
        remove_tempdir(process.socket_dir)


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


@pytest.mark.skipif(_SYS_TGKILL is None, reason=f"tgkill number unknown on {platform.machine()}")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_daemon_exits_on_a_signal_that_lands_on_a_worker_thread(signum: int) -> None:
    """The kernel may deliver a process-directed signal to any thread; aim it at a worker."""
    process = start_daemon("--sim-devices", "2", "--sim-memory", "16MiB")
    try:
        with Client(process.endpoint, timeout=10) as client:
            worker_tid = client.status()["devices"][1]["worker"]["native_id"]
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(_SYS_TGKILL, process.process.pid, worker_tid, signum) == 0
        try:
            code = process.process.wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail("cuctxd ignored a signal delivered to one of its worker threads")
        assert code == 0, process.log()
        assert not process.socket_path.exists()
    finally:
        process.stop()
        remove_tempdir(process.socket_dir)


def test_a_second_daemon_on_a_live_socket_refuses_to_start(daemon: DaemonProcess) -> None:
    try:
        done = cuctxd("--backend", "sim", "--endpoint", daemon.endpoint, timeout=10)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the second cuctxd did not exit after failing to listen:\n{hung.stderr!r}")
    assert done.returncode != 0
    assert "already listens" in done.stderr
    assert daemon.socket_path.exists()
    assert cuctx("--endpoint", daemon.endpoint, "ping").returncode == 0


def test_a_stale_socket_file_is_replaced() -> None:
    directory = short_tempdir()
    stale = directory / "d.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: what a killed daemon leaves
        dead.bind(str(stale))
    process = subprocess.Popen(
        [sys.executable, "-m", "cuctxd.daemon", "--backend", "sim", "--endpoint", f"ipc://{stale}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO,
    )
    try:
        assert process.stdout is not None
        assert "listening on" in process.stdout.readline()
        done = cuctx("--endpoint", f"ipc://{stale}", "ping")
        assert done.returncode == 0, done.stderr
    finally:
        process.terminate()
        _, err = process.communicate(timeout=20)
        remove_tempdir(directory)
    assert process.returncode == 0, err
    assert "removed the stale socket" in err


@pytest.mark.skipif(cuda_driver_loads(), reason="a CUDA driver is installed here")
def test_backend_cuda_without_a_gpu_exits_non_zero_with_a_clear_message() -> None:
    directory = short_tempdir()
    try:
        done = cuctxd("--backend", "cuda", "--endpoint", f"ipc://{directory}/d.sock")
        assert done.returncode != 0
        assert "backend 'cuda' was requested but is unavailable" in done.stderr
        assert "'sim'" in done.stderr  # says what would work instead
        assert "Traceback" not in done.stderr
        assert "listening" not in done.stdout
        assert not (directory / "d.sock").exists()
    finally:
        remove_tempdir(directory)


def test_bad_daemon_arguments_exit_non_zero() -> None:
    assert cuctxd("--sim-devices", "-1", "--backend", "sim").returncode != 0
    done = cuctxd("--max-payload", "lots", "--backend", "sim")
    assert done.returncode == 2
    assert "--max-payload" in done.stderr
