"""What a daemon sweeps beside its ipc:// socket at start: the ``.paused-*`` directories a daemon killed while
refusing connections left, and only those."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from cuctxd.daemon.service.endpoint import PAUSED_SETTLE_S, EndpointInUse, clear_stale_paused


def _parked(directory: Path, name: str, holds: str | None, *, listening: bool = False) -> socket.socket | None:
    """A paused directory ``name`` holding a socket file ``holds`` (bound; listening or left dead)."""
    paused = directory / name
    paused.mkdir(mode=0o700)
    if holds is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(paused / holds))
    if listening:
        sock.listen(1)
        return sock
    sock.close()
    return None


def test_only_this_endpoints_dead_or_settled_empty_paused_directories_go(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    _parked(tmp_path, ".paused-dead0000", "d.sock")
    _parked(tmp_path, ".paused-other000", "other.sock")  # another endpoint's
    _parked(tmp_path, ".paused-young000", None)  # perhaps a live daemon's, between mkdtemp and rename
    _parked(tmp_path, ".paused-old00000", None)
    old = time.time() - PAUSED_SETTLE_S - 1
    os.utime(tmp_path / ".paused-old00000", (old, old))
    (tmp_path / ".paused-notmine0").mkdir()
    (tmp_path / ".paused-notmine0" / "d.sock").write_text("not a socket")
    (tmp_path / ".paused-link0000").symlink_to(tmp_path / ".paused-other000")
    (tmp_path / ".paused-toolong00").mkdir()  # not a name mkdtemp gives
    clear_stale_paused(path)
    left = sorted(entry.name for entry in tmp_path.iterdir())
    assert left == [".paused-link0000", ".paused-notmine0", ".paused-other000", ".paused-toolong00",
                    ".paused-young000"]


def test_a_live_daemons_paused_socket_is_in_use(tmp_path: Path) -> None:
    live = _parked(tmp_path, ".paused-live0000", "d.sock", listening=True)
    assert live is not None
    with live, pytest.raises(EndpointInUse, match="paused at max_connections"):
        clear_stale_paused(tmp_path / "d.sock")
    assert (tmp_path / ".paused-live0000" / "d.sock").exists()


def test_a_missing_directory_is_nothing_to_sweep(tmp_path: Path) -> None:
    clear_stale_paused(tmp_path / "absent" / "d.sock")
