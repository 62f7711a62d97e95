"""``preload``: checkpoints published at start, before the daemon says ready; a missing or bad one is logged
and skipped, the rest served; a restarted daemon serves the same names again (real daemon, real ``cuctx load``
subprocesses, real CLI)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from cuctxd import Client
from tests.checkpoint_files import write_shard
from tests.helpers import REPO, DaemonProcess, client_env, freeze, running_daemon, wait_until

TENSORS = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(16, dtype=np.float16)}


def ready_probe(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's readiness probe: ``cuctx ping --ready``."""
    return subprocess.run([sys.executable, "-m", "cuctxd.client", "--timeout", "10", "ping", "--ready"],
                          env=dict(client_env(), CUCTXD_ENDPOINT=daemon.endpoint), capture_output=True, text=True,
                          timeout=30, cwd=REPO)


def test_checkpoints_load_at_start_bad_ones_are_skipped_and_a_restart_serves_them_again(tmp_path: Path) -> None:
    good = write_shard(tmp_path / "model.safetensors", TENSORS)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"not a safetensors header")
    preload = ["--preload", f"good={good}", "--preload", f"missing={tmp_path / 'nowhere.safetensors'}",
               "--preload", f"bad={bad}", "--preload", f"both={good}@0,1"]
    digests = {}
    for start in range(2):
        with running_daemon(*preload) as daemon, Client(daemon.endpoint) as client:
            assert wait_until(lambda c=client: c.status()["ready"], 60), daemon.log()
            probe = ready_probe(daemon)
            assert probe.returncode == 0, probe.stderr
            for name in ("good", "both@0", "both@1"):
                descriptor = client.lookup(name)
                digests.setdefault(name, descriptor.manifest)
                assert descriptor.manifest and descriptor.manifest == digests[name], f"{name} after restart {start}"
            assert client.lookup("both@1").device == 1
            names = {entry["name"] for entry in client.list_shared()}
            assert "missing" not in names and "bad" not in names
            log = daemon.log()
            assert "preload: skipping missing on device 0" in log and "preload: skipping bad on device 0" in log, log
            assert "3 of 5 checkpoint load(s) published" in log, log


def loaders(daemon: DaemonProcess) -> list[int]:
    """The daemon's child processes (its preload's ``cuctx load``)."""
    pid = daemon.process.pid
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return children


def test_the_daemon_is_not_ready_while_a_checkpoint_loads(tmp_path: Path) -> None:
    """The loader, caught as it starts and stopped (SIGSTOP), keeps the probe failing until it is let go."""
    checkpoint = write_shard(tmp_path / "model.safetensors", TENSORS)
    with running_daemon("--preload", f"model={checkpoint}") as daemon:
        found: list[int] = []
        assert wait_until(lambda: found.extend(loaders(daemon)) or found, 30, interval=0.001), daemon.log()
        freeze(found[0])
        try:
            probe = ready_probe(daemon)
            assert probe.returncode == 1 and "still preloading" in probe.stderr, (probe.stdout, probe.stderr)
        finally:
            os.kill(found[0], signal.SIGCONT)
        with Client(daemon.endpoint) as client:
            assert wait_until(lambda: client.status()["ready"], 60), daemon.log()
            assert client.lookup("model").size > 0
        assert ready_probe(daemon).returncode == 0
