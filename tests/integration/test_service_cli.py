"""``cuctx status --watch`` and ``cuctx doctor`` against a real daemon (and without one)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    DaemonProcess,
    client_env,
    cuctx,
    make_key_files,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    tcp_endpoint,
)

CLEAR = "\x1b[H\x1b[2J"
#: Starts cuctx with SIGINT handled as in an interactive shell, even when this test run ignores it (a
#: background job, ``nohup``): an ignored SIGINT is inherited, and Python then installs no handler.
INTERACTIVE_CUCTX = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'cuctx'; runpy.run_module('cuctxd.client', run_name='__main__')")


# --- status --watch ----------------------------------------------------------------------------


def test_watch_redraws_count_times_then_exits_0(daemon: DaemonProcess) -> None:
    started = time.monotonic()
    done = cuctx("--endpoint", daemon.endpoint, "status", "--watch", "--interval", "0.2", "--count", "3")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert CLEAR not in done.stdout and "\x1b" not in done.stdout  # a pipe gets plain frames
    frames = re.split(r"^(?=every )", done.stdout, flags=re.MULTILINE)
    assert frames[0] == ""
    assert len(frames) == 4
    for frame in frames[1:]:
        assert frame.startswith(f"every 0.2 s: {daemon.endpoint}")
        assert "(Ctrl-C to quit)" in frame
        assert f"pid {daemon.process.pid}" in frame
        assert "device 1 cuctxd simulated GPU" in frame
    assert took >= 0.4  # two intervals between three frames


def test_watch_on_a_terminal_clears_the_screen_before_each_frame(daemon: DaemonProcess) -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen([sys.executable, "-m", "cuctxd.client", "--endpoint", daemon.endpoint, "status",
                                    "--watch", "-n", "0.05", "--count", "2"], stdout=terminal,
                                   stderr=subprocess.PIPE, env=client_env(), cwd=REPO)
        os.close(terminal)
        terminal = -1
        out = _read_until_closed(controller, timeout=30)
        _, err = process.communicate(timeout=20)
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    assert process.returncode == 0, err
    assert out.count(CLEAR) == 2
    assert out.startswith(CLEAR + "every 0.05 s: ")


def _read_until_closed(fd: int, timeout: float) -> str:
    """What a pty's other side wrote, until it closed (EIO on Linux) or ``timeout``."""
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_watch_json_prints_one_status_per_line(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "status", "--watch", "-n", "0.05", "--count", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert [json.loads(line)["pid"] for line in lines] == [daemon.process.pid] * 2
    assert CLEAR not in done.stdout


def test_ctrl_c_ends_the_watch_with_0(daemon: DaemonProcess) -> None:
    process = subprocess.Popen([sys.executable, "-c", INTERACTIVE_CUCTX, "--endpoint", daemon.endpoint, "status",
                                "-w", "-n", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=client_env(), cwd=REPO)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("every 0.1 s: ")  # it is drawing
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "Traceback" not in err


def test_watch_keeps_trying_when_there_is_no_daemon() -> None:
    directory = short_tempdir()
    try:
        done = cuctx("--endpoint", f"ipc://{directory}/absent.sock", "--timeout", "0.2", "status", "--watch",
                     "--interval", "0.05", "--count", "2")
    finally:
        remove_tempdir(directory)
    assert done.returncode == 1
    assert done.stdout.count("every 0.05 s: ") == 2
    assert done.stdout.count("CUCTXD_NO_DAEMON") == 2


# --- doctor ----------------------------------------------------------------------------------


def test_doctor_passes_against_a_sim_daemon(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split(":")[0].split()[1]: line for line in done.stdout.splitlines() if line[:4] in
             ("PASS", "WARN", "FAIL")}
    assert set(lines) == {"driver", "devices", "socket", "daemon", "protocol", "ipc"}
    assert lines["socket"].startswith("PASS") and "directory 0700" in lines["socket"]
    assert lines["daemon"].startswith("PASS")
    assert re.search(r"answers ping in \d+(\.\d)? (µs|ms|s)$", lines["daemon"]), lines["daemon"]
    assert lines["protocol"].startswith("PASS") and "backend sim" in lines["protocol"]
    assert lines["ipc"].startswith("PASS") and "sim backend, same host" in lines["ipc"]
    assert not any(line.startswith("FAIL") for line in lines.values())


def test_doctor_json(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "doctor")
    assert done.returncode == 0, done.stderr
    checks = json.loads(done.stdout)
    assert [c["check"] for c in checks] == ["driver", "devices", "socket", "daemon", "protocol", "ipc"]
    assert all(c["status"] in ("PASS", "WARN", "FAIL") for c in checks)


def test_doctor_fails_without_a_daemon() -> None:
    directory = short_tempdir()
    try:
        done = cuctx("--endpoint", f"ipc://{directory}/absent.sock", "--timeout", "0.3", "doctor")
    finally:
        remove_tempdir(directory)
    assert done.returncode == 1
    out = done.stdout
    assert "FAIL  socket:" in out and "absent.sock" in out
    assert "FAIL  daemon: no answer" in out
    assert "WARN  protocol: not checked" in out
    assert "Traceback" not in done.stderr


def test_doctor_warns_about_a_socket_directory_others_can_enter(daemon: DaemonProcess) -> None:
    directory = daemon.socket_path.parent
    mode = directory.stat().st_mode & 0o777
    os.chmod(directory, 0o755)
    try:
        done = cuctx("--endpoint", daemon.endpoint, "doctor")
    finally:
        os.chmod(directory, mode)
    assert done.returncode == 0, done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(("PASS  socket", "WARN  socket"))]
    assert line.startswith("WARN") and "other users can enter it" in line


# --- doctor against a CURVE daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def curve_daemon() -> Iterator[tuple[str, Path, Path]]:
    """A daemon on tcp:// with CURVE; yields its endpoint, its public key and an allowed client's secret key."""
    root = short_tempdir()
    keys = make_key_files(root)
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--server-key", str(keys.server_secret),
                           "--allow-dir", str(keys.allow_dir), "--sim-devices", "1", "--sim-memory", "16MiB")
    try:
        yield tcp_endpoint(process), keys.server_public, keys.client_secret("alice")
    finally:
        process.stop()
        remove_tempdir(process.socket_dir)
        remove_tempdir(root)


def test_doctor_uses_the_curve_keys_that_ping_uses(curve_daemon: tuple[str, Path, Path]) -> None:
    endpoint, server_key, client_key = curve_daemon
    keys = ("--server-key", str(server_key), "--client-key", str(client_key))
    assert cuctx("ping", "--endpoint", endpoint, *keys).returncode == 0
    done = cuctx("doctor", "--endpoint", endpoint, *keys, "--json")
    checks = {c["check"]: c for c in json.loads(done.stdout)}
    assert checks["daemon"]["status"] == "PASS", checks["daemon"]
    assert checks["protocol"]["status"] == "PASS", checks["protocol"]
    assert done.returncode == 0, done.stdout


def test_doctor_without_the_keys_says_the_curve_daemon_does_not_answer(curve_daemon: tuple[str, Path, Path]) -> None:
    endpoint, _, _ = curve_daemon
    done = cuctx("doctor", "--endpoint", endpoint, "--timeout", "0.5")
    assert done.returncode == 1
    assert "FAIL  daemon: no answer" in done.stdout
