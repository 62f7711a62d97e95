"""CURVE on tcp://, keygen, the ipc:// group, and the named limits, against real daemon processes."""

from __future__ import annotations

import asyncio
import grp
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuctxd.client import AsyncClient, Client
from cuctxd.protos.errors import DaemonTimeout, LimitExceeded
from tests.helpers import (
    REPO,
    DaemonProcess,
    KeyFiles,
    client_env,
    keygen,
    make_key_files,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    tcp_endpoint,
)

KEYGEN_FAST = 0.5  # timeout for clients expected to be turned away: they wait all of it


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyFiles]:
    """A server pair, client 'alice' (allowed) and 'mallory' (not allowed)."""
    root = short_tempdir()
    yield make_key_files(root, allowed=("alice",), others=("mallory",))
    remove_tempdir(root)


@pytest.fixture(scope="module")
def curve_daemon(keys: KeyFiles) -> Iterator[tuple[DaemonProcess, str]]:
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--server-key", str(keys.server_secret),
                           "--allow-dir", str(keys.allow_dir), "--sim-devices", "1", "--sim-memory", "16MiB")
    yield process, tcp_endpoint(process)
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, process.log()


def test_keygen_writes_a_private_secret_and_prints_the_public_key(tmp_path: Path) -> None:
    done = keygen(tmp_path / "k", "--name", "node1")
    assert done.returncode == 0, done.stderr
    public, secret = tmp_path / "k" / "node1.key", tmp_path / "k" / "node1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert str(public) in done.stdout and str(secret) in done.stdout
    z85 = re.search(r'public-key = "(.{40})"', public.read_text())
    assert z85 is not None and z85.group(1) in done.stdout
    again = keygen(tmp_path / "k", "--name", "node1")
    assert again.returncode == 1 and "exists" in again.stderr, "an existing key is never overwritten silently"


def test_an_allowed_client_key_works_end_to_end(keys: KeyFiles, curve_daemon: tuple[DaemonProcess, str]) -> None:
    _, endpoint = curve_daemon
    with Client(endpoint, timeout=10, server_key=keys.server_public,
                client_key=keys.client_secret("alice")) as client:
        buffer = client.alloc(4096)
        client.write(buffer, b"\x07" * 4096)
        assert client.read(buffer) == b"\x07" * 4096


def test_the_async_client_speaks_curve_too(keys: KeyFiles, curve_daemon: tuple[DaemonProcess, str]) -> None:
    _, endpoint = curve_daemon

    async def main() -> float:
        async with AsyncClient(endpoint, timeout=10, server_key=keys.server_public,
                               client_key=keys.client_secret("alice")) as client:
            return await client.ping()

    assert asyncio.run(main()) > 0


def test_the_ipc_endpoint_of_a_curve_daemon_needs_keys_too(keys: KeyFiles,
                                                           curve_daemon: tuple[DaemonProcess, str]) -> None:
    process, _ = curve_daemon
    with Client(process.endpoint, timeout=10, server_key=keys.server_public,
                client_key=keys.client_secret("alice")) as client:
        assert client.ping() > 0
    with pytest.raises(DaemonTimeout):
        Client(process.endpoint, timeout=KEYGEN_FAST)


@pytest.mark.parametrize("who", ["mallory", "no curve", "throwaway key"])
def test_a_client_not_allowed_in_gets_a_quick_timeout(keys: KeyFiles, curve_daemon: tuple[DaemonProcess, str],
                                                      who: str) -> None:
    _, endpoint = curve_daemon
    started = time.monotonic()
    with pytest.raises(DaemonTimeout) as error:
        if who == "mallory":
            Client(endpoint, timeout=KEYGEN_FAST, server_key=keys.server_public,
                   client_key=keys.client_secret("mallory"))
        elif who == "throwaway key":
            Client(endpoint, timeout=KEYGEN_FAST, server_key=keys.server_public)
        else:
            Client(endpoint, timeout=KEYGEN_FAST)
    assert time.monotonic() - started < KEYGEN_FAST + 3
    if who != "no curve":
        assert "allow_dir" in str(error.value), "a CURVE timeout points at the key setup"


def test_cuctx_takes_the_key_flags(keys: KeyFiles, curve_daemon: tuple[DaemonProcess, str]) -> None:
    _, endpoint = curve_daemon
    done = subprocess.run([sys.executable, "-m", "cuctxd.client", "--endpoint", endpoint, "--timeout", "10",
                           "--server-key", str(keys.server_public), "--client-key", str(keys.client_secret("alice")),
                           "ping"], capture_output=True, text=True, env=client_env(), cwd=REPO, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "pong" in done.stdout


def test_group_opens_the_ipc_socket_to_that_group(stop_after: list[DaemonProcess]) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    parent = short_tempdir()
    process = start_daemon("--group", group, endpoint=f"ipc://{parent}/made-by-the-daemon/d.sock")
    process.socket_dir = parent  # removed whole after the stop
    stop_after.append(process)
    directory, socket_file = process.socket_path.parent.stat(), process.socket_path.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o770 and directory.st_gid == os.getgid()
    assert stat.S_IMODE(socket_file.st_mode) == 0o660 and socket_file.st_gid == os.getgid()
    with Client(process.endpoint, timeout=10) as client:
        assert client.ping() > 0


def test_without_group_the_ipc_socket_stays_private(stop_after: list[DaemonProcess]) -> None:
    process = start_daemon()
    stop_after.append(process)
    assert stat.S_IMODE(process.socket_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(process.socket_path.stat().st_mode) == 0o600


def test_max_sessions_per_peer_names_the_limit(stop_after: list[DaemonProcess]) -> None:
    process = start_daemon("--max-sessions-per-peer", "2")
    stop_after.append(process)
    with Client(process.endpoint, timeout=10), Client(process.endpoint, timeout=10):
        with pytest.raises(LimitExceeded) as error:
            Client(process.endpoint, timeout=10)
        assert "max_sessions_per_peer" in str(error.value)
    with Client(process.endpoint, timeout=10) as client:  # closing one makes room again
        assert client.ping() > 0


def test_max_sessions_per_peer_counts_curve_keys(keys: KeyFiles, stop_after: list[DaemonProcess]) -> None:
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--server-key", str(keys.server_secret),
                           "--allow-dir", str(keys.allow_dir), "--max-sessions-per-peer", "1")
    stop_after.append(process)
    endpoint = tcp_endpoint(process)
    alice = {"server_key": keys.server_public, "client_key": keys.client_secret("alice")}
    with Client(endpoint, timeout=10, **alice):  # type: ignore[arg-type]
        with pytest.raises(LimitExceeded) as error:
            Client(endpoint, timeout=10, **alice)  # type: ignore[arg-type]
        assert "key:" in str(error.value)


def test_max_objects_per_session_names_the_limit(stop_after: list[DaemonProcess]) -> None:
    process = start_daemon("--max-objects-per-session", "3")
    stop_after.append(process)
    with Client(process.endpoint, timeout=10) as client:
        buffer = client.alloc(256)
        client.create_stream()
        client.create_event()
        for make in (lambda: client.alloc(256), client.create_stream, client.create_event, client.create_context):
            with pytest.raises(LimitExceeded) as error:
                make()
            assert "max_objects_per_session" in str(error.value)
        client.free(buffer)
        client.alloc(256)  # freeing made room
        with Client(process.endpoint, timeout=10) as other:  # the limit is per session
            other.alloc(256)
