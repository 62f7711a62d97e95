"""``cuctx status --watch`` and ``cuctx doctor`` against a real daemon (and without one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO, DaemonProcess, client_env, remove_tempdir, short_tempdir

CLEAR = "\x1b[H\x1b[2J"


def cuctx(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cuctxd.client", *args], capture_output=True, text=True,
                          env=client_env(), cwd=REPO, timeout=timeout)


# --- status --watch ----------------------------------------------------------------------------


def test_watch_redraws_count_times_then_exits_0(daemon: DaemonProcess) -> None:
    started = time.monotonic()
    done = cuctx("--endpoint", daemon.endpoint, "status", "--watch", "--interval", "0.2", "--count", "3")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    frames = done.stdout.split(CLEAR)
    assert frames[0] == ""
    assert len(frames) == 4
    for frame in frames[1:]:
        assert frame.startswith(f"every 0.2 s: {daemon.endpoint}")
        assert "(Ctrl-C to quit)" in frame
        assert f"pid {daemon.process.pid}" in frame
        assert "device 1 cuctxd simulated GPU" in frame
    assert took >= 0.4  # two intervals between three frames


def test_watch_json_prints_one_status_per_line(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "--json", "status", "--watch", "-n", "0.05", "--count", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert [json.loads(line)["pid"] for line in lines] == [daemon.process.pid] * 2
    assert CLEAR not in done.stdout


def test_ctrl_c_ends_the_watch_with_0(daemon: DaemonProcess) -> None:
    process = subprocess.Popen([sys.executable, "-m", "cuctxd.client", "--endpoint", daemon.endpoint, "status", "-w",
                                "-n", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=client_env(), cwd=REPO)
    try:
        assert process.stdout is not None
        assert process.stdout.read(len(CLEAR)) == CLEAR  # it is drawing
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
    assert done.stdout.count(CLEAR) == 2
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
