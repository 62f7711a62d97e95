"""First contact, round 2 (issue 29): what a new user hit with the two CLIs, against real daemon processes.

``cuctx load``'s errors, ``--device 0``, a socket this user may not reach, ``--timeout`` while connecting,
the commands users expect (``unpublish``, ``kill``, ``shutdown``, device memory), and the small ones
(did-you-mean, one-line usage errors of both CLIs, an endpoint under a file, a tcp endpoint without keys).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import cuctxd
from cuctxd import Client, NotOwner, SessionLost
from tests.helpers import (
    DaemonProcess,
    client_env,
    cuctx,
    freeze,
    launch_daemon,
    remove_tempdir,
    short_tempdir,
    tcp_endpoint,
)
from tests.helpers import cuctxd as run_cuctxd
from tests.unit_file import prepare_runtime_directory, service_command

MiB = 1 << 20


def one_line_error(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The single stderr line of a command that failed with ``code``, and nothing on stdout."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    pytest.importorskip("safetensors", reason="the safetensors package writes the format")
    from safetensors.numpy import save_file

    path = tmp_path / "tiny.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32)}, str(path))
    return path


# --- 1, 2: cuctx load ------------------------------------------------------------------------------


def test_cuctx_load_says_the_real_error_in_one_line(daemon: DaemonProcess, model_file: Path) -> None:
    from safetensors.numpy import save_file

    load = ("--endpoint", daemon.endpoint, "load", str(model_file))
    assert cuctx(*load, "--name", "first-contact").returncode == 0
    try:
        other = model_file.with_name("other.safetensors")
        save_file({"w": np.arange(64, dtype=np.float32) + 1}, str(other))
        line = one_line_error(cuctx("--endpoint", daemon.endpoint, "load", str(other), "--name", "first-contact"), 1)
        assert "CUCTXD_ERROR_NAME_EXISTS" in line and "--replace" in line
        assert "CUDA_ERROR_INVALID_DEVICE" in one_line_error(cuctx(*load, "--name", "elsewhere", "--device", "5"), 1)
        assert "--name" in one_line_error(cuctx(*load, "--name", ""), 2)
    finally:
        assert cuctx("--endpoint", daemon.endpoint, "unpublish", "first-contact").returncode == 0


def test_cuctx_load_out_of_memory_is_one_line(start_daemons: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="the safetensors package writes the format")
    from safetensors.numpy import save_file

    daemon = start_daemons("--sim-devices", "1", "--session-quota", "1MiB")
    path = tmp_path / "big.safetensors"
    save_file({"w": np.zeros(2 * MiB, dtype=np.uint8)}, str(path))
    line = one_line_error(cuctx("--endpoint", daemon.endpoint, "load", str(path), "--name", "big"), 1)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in line


def test_cuctx_load_takes_device_0_as_its_help_says(daemon: DaemonProcess, model_file: Path) -> None:
    assert "(default: 0)" in cuctx("help", "load").stdout
    done = cuctx("--endpoint", daemon.endpoint, "load", str(model_file), "--name", "on-0", "--device", "0")
    assert done.returncode == 0, done.stderr
    assert "on device 0" in done.stdout
    assert "must be 0 or more" in one_line_error(cuctx("load", str(model_file), "--name", "x", "--device", "-1"), 2)
    assert cuctx("--endpoint", daemon.endpoint, "unpublish", "on-0").returncode == 0


# --- 5: a socket this user may not reach ---------------------------------------------------------


def _as_a_user_who_may_not_enter(daemon: DaemonProcess) -> Iterator[list[str]]:
    """The command prefix of a process that may not enter the daemon's socket directory: as root, another
    uid (root enters every directory); as anyone else, this user with the directory's mode taken away."""
    if os.geteuid() == 0:
        yield ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        return
    mode = daemon.socket_dir.stat().st_mode
    daemon.socket_dir.chmod(0)
    try:
        yield []
    finally:
        daemon.socket_dir.chmod(mode)


def _cuctx_as(prefix: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "cuctxd.client", *args], capture_output=True, text=True,
                          env=client_env(), cwd="/", timeout=30)


def test_permission_denied_is_said_at_once_with_what_to_change(daemon: DaemonProcess) -> None:
    for prefix in _as_a_user_who_may_not_enter(daemon):
        started = time.monotonic()
        line = one_line_error(_cuctx_as(prefix, "--endpoint", daemon.endpoint, "ping"), 1)
        assert time.monotonic() - started < 4, "waited for a timeout"
        assert "CUCTXD_NO_ACCESS" in line and "permission denied" in line and str(daemon.socket_dir) in line
        assert "group" in line and "timeout" not in line.lower()
        started = time.monotonic()
        doctor = _cuctx_as(prefix, "--endpoint", daemon.endpoint, "doctor")
        assert time.monotonic() - started < 4, "doctor waited for a timeout"
        assert doctor.returncode == 1
        assert "FAIL  socket: cannot reach" in doctor.stdout and "permission denied" in doctor.stdout
        assert "is cuctxd running" not in doctor.stdout, doctor.stdout


# --- 6: --timeout covers connecting -------------------------------------------------------------


def test_timeout_covers_the_handshake(start_daemons: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemons("--sim-devices", "1")
    freeze(daemon.process.pid)  # listening, answering nobody
    try:
        started = time.monotonic()
        line = one_line_error(cuctx("--endpoint", daemon.endpoint, "--timeout", "5.5", "ping"), 1)
        took = time.monotonic() - started
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert "within 5.5 s" in line and took >= 5.4, (line, took)  # not the handshake's own 5 s
    assert "connecting included (default 10)" in " ".join(cuctx("help", "ping").stdout.split())


# --- 10: commands users expect --------------------------------------------------------------------


def test_unpublish_and_kill_from_the_cli(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, name="victim") as victim:
        victim.publish(victim.alloc(64, shareable=True), "to-remove")
        done = cuctx("--endpoint", daemon.endpoint, "unpublish", "to-remove")
        assert (done.returncode, done.stdout.strip()) == (0, "unpublished 'to-remove'"), done.stderr
        assert "CUCTXD_ERROR_NOT_FOUND" in one_line_error(cuctx("--endpoint", daemon.endpoint, "unpublish",
                                                                "to-remove"), 1)
        done = cuctx("--endpoint", daemon.endpoint, "kill", str(victim.session_id))
        assert (done.returncode, done.stdout.strip()) == (0, f"closed session {victim.session_id}"), done.stderr
        with pytest.raises(SessionLost, match=r"closed by session \d+ \(cuctx, pid \d+, uid \d+\)"):
            victim.device_count()
        with Client(daemon.endpoint) as observer:
            assert victim.session_id not in {s["session"] for s in observer.status()["sessions"]}
    assert "no open session 999999" in one_line_error(cuctx("--endpoint", daemon.endpoint, "kill", "999999"), 1)


def test_only_the_sessions_user_or_the_daemons_may_kill_and_only_the_daemons_may_shut_it_down(
        start_daemons: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemons("--sim-devices", "1", "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")
    with Client(daemon.endpoint, name="local") as local, Client(tcp_endpoint(daemon), name="remote") as remote:
        with pytest.raises(NotOwner, match="only that user or the daemon's own user"):
            remote.close_session(local.session_id)  # tcp://: its uid is unknown, so not local's user
        with pytest.raises(NotOwner, match="only the daemon's own user"):
            remote.shutdown()
        assert local.device_count() == 1
        remote.close_session(remote.session_id)  # its own session it may close
    with Client(daemon.endpoint) as admin, Client(tcp_endpoint(daemon), name="remote") as remote:
        admin.close_session(remote.session_id)  # the daemon's user may close anyone's
        with pytest.raises(SessionLost):
            remote.device_count()


def test_cuctx_shutdown_drains_and_the_daemon_exits_0(start_daemons: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemons("--sim-devices", "1")
    done = cuctx("--endpoint", daemon.endpoint, "shutdown")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cuctxd (pid {daemon.process.pid}) at {daemon.endpoint} has stopped"
    assert daemon.process.wait(10) == 0
    assert "shutdown asked by session" in daemon.log() and "(cuctx, pid" in daemon.log()
    assert not daemon.socket_path.exists()


def test_devices_and_status_show_device_memory(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as holder:
        holder.alloc(3 * MiB, device=1)
        done = cuctx("--endpoint", daemon.endpoint, "devices")
        assert done.returncode == 0, done.stderr
        header, _, second = done.stdout.splitlines()
        assert header.split()[3:7] == ["MEMORY", "USED", "FREE", "CUCTXD"]
        assert "3 MiB  61 MiB  3 MiB" in second, second  # USED, FREE, CUCTXD
        (dev1,) = [d for d in json.loads(cuctx("--endpoint", daemon.endpoint, "--json", "devices").stdout)
                   if d["index"] == 1]
        assert dev1["memory"]["allocated"] == 3 * MiB and dev1["memory"]["total"] == 64 * MiB
        assert dev1["memory"]["free"] + dev1["memory"]["used"] == 64 * MiB
        status = cuctx("--endpoint", daemon.endpoint, "status").stdout
        assert "memory: 3 MiB used, 61 MiB free of 64 MiB (whole device); cuctxd holds 3 MiB" in status


# --- 11: the small ones -------------------------------------------------------------------------


def test_a_misspelled_command_gets_a_did_you_mean() -> None:
    line = one_line_error(cuctx("pnig"), 2)
    assert "invalid choice: 'pnig'; did you mean 'ping'?" in line and line.endswith("(try 'cuctx --help')")
    assert "did you mean 'status'?" in one_line_error(cuctx("help", "stauts"), 2)


def test_a_bad_timeout_says_what_it_needs() -> None:
    line = one_line_error(cuctx("--timeout", "abc", "ping"), 2)
    assert "argument --timeout: not a number of seconds: 'abc'" in line and "_positive" not in line
    assert "must be more than 0 seconds" in one_line_error(cuctx("ping", "--timeout", "0"), 2)


def test_the_tensor_functions_import_from_cuctxd() -> None:
    assert cuctxd.publish_tensors is cuctxd.client.tensors.publish_tensors
    assert {"open_tensors", "publish_tensors", "NoAccess", "SessionClosed"} <= set(cuctxd.__all__)


def test_cuctxd_argument_errors_are_one_line_with_a_pointer_to_help() -> None:
    line = one_line_error(run_cuctxd("--max-payload", "lots", "--backend", "sim"), 2)
    assert line.startswith("cuctxd: argument --max-payload: not a size: 'lots'") and "(try 'cuctxd --help')" in line
    assert "did you mean --lease-ttl?" in one_line_error(run_cuctxd("--lease-tl", "4"), 2)
    assert "did you mean 'cuda'?" in one_line_error(run_cuctxd("--backend", "cdua"), 2)


def test_a_tcp_endpoint_without_keys_names_the_flags() -> None:
    line = one_line_error(run_cuctxd("--backend", "sim", "--endpoint", "tcp://127.0.0.1:5999"), 2)
    assert line.startswith("cuctxd: --endpoint: tcp://127.0.0.1:5999 is a tcp:// endpoint")
    assert "--server-key" in line and "--insecure-tcp" in line and "configuration key" not in line


def test_an_endpoint_under_a_regular_file_says_so() -> None:
    directory = short_tempdir()
    try:
        (directory / "a-file").write_text("")
        for endpoint in (f"ipc://{directory}/a-file/d.sock", f"ipc://{directory}/a-file/sub/d.sock"):
            done = run_cuctxd("--backend", "sim", "--endpoint", endpoint)
            assert done.returncode == 2, done.stderr
            assert f"{directory}/a-file is a file, not a directory" in done.stderr
            assert "symbolic link" not in done.stderr and "Traceback" not in done.stderr
    finally:
        remove_tempdir(directory)


def test_a_group_deployment_works_from_the_unit_as_shipped() -> None:
    """The shipped unit's RuntimeDirectory (mode 0700) and ExecStart, with ``group`` in the TOML file: the
    daemon opens the directory it was given to the group (0770) and its sockets (0660). As root, a user of
    that group then connects, and one outside it gets NoAccess at once."""
    group = os.getgid() if os.geteuid() != 0 else 65534
    root = short_tempdir()
    try:
        runtime, config = root / "run", root / "etc"
        runtime.mkdir(mode=0o755)
        root.chmod(0o755)  # as /run is: anyone may pass through to the service's own directory
        (config / "cuctxd").mkdir(parents=True)
        (config / "cuctxd" / "cuctxd.toml").write_text(f'group = "{group}"\nbackend = "sim"\nsim_devices = 1\n')
        environment = dict(client_env(), **prepare_runtime_directory(runtime))
        assert Path(environment["RUNTIME_DIRECTORY"]).stat().st_mode & 0o777 == 0o700
        _, *arguments = service_command(runtime, config)
        endpoint = arguments[arguments.index("--endpoint") + 1]
        daemon = launch_daemon([sys.executable], *arguments, endpoint=endpoint, ipc=False, env=environment)
        try:
            info = daemon.socket_dir.stat()
            assert (info.st_mode & 0o777, info.st_gid) == (0o770, group)
            assert daemon.socket_path.stat().st_mode & 0o777 == 0o660
            if os.geteuid() == 0:
                member = ["setpriv", "--reuid=65534", f"--regid={group}", "--clear-groups"]
                outsider = ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"]
                done = _cuctx_as(member, "--endpoint", endpoint, "ping")
                assert done.returncode == 0, done.stderr
                line = one_line_error(_cuctx_as(outsider, "--endpoint", endpoint, "ping"), 1)
                assert "CUCTXD_NO_ACCESS" in line and "join the group" in line
        finally:
            assert daemon.stop() == 0, daemon.log()
    finally:
        remove_tempdir(root)
