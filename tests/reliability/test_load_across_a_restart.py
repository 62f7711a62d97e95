"""``cuctx load`` while its daemon is SIGKILLed (issue 41, item 8): restarted at once on its endpoint (plainly,
or under the test service manager), or left dead.

The load is caught in its middle without a race: the CLI's progress line goes to a terminal whose buffer
the test has filled, so the CLI cannot get past its first progress line, which comes once every slot of its
load ring has been filled and sent, with the rest of the checkpoint still to read and send. Once the
load's buffer is allocated, the daemon is killed (and replaced) and the terminal drained. The CLI must
exit within :data:`AT_ONCE_S` of the kill (its reader threads stopped, no call waiting out the 10 s
timeout), with status 1 and, after the progress line if it got to show one, one line naming the lost
session and saying that the daemon went away during the load: no traceback, and no
``CUCTXD_ERROR_BAD_ARGUMENT`` (the checkpoint is fine).
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cuctxd.client import Client
from tests.checkpoint_files import write_shard
from tests.helpers import REPO, client_env, wait_until
from tests.reliability.restarts import RESTARTS, TIMEOUT, Scene

#: A checkpoint of 24 slots' worth (8 MiB each, a tensor spanning several): more than a load ring has (at
#: most 16), so that the load reports progress before its end.
TENSORS, TENSOR_BYTES = 3, 64 << 20
SIM = ("--sim-devices", "1", "--sim-memory", "512MiB")
#: What the CLI may take past the kill to exit: a liveness probe (1 s), the replacement's start, and a
#: loaded 2-core machine's slack; well below the CLI's ``--timeout`` (:data:`TIMEOUT`).
AT_ONCE_S = 3.0

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def checkpoint(workdir: Path) -> Iterator[Path]:
    count = TENSOR_BYTES // 4
    yield write_shard(workdir / "model.safetensors",
                      {f"layer{i}": np.full(count, i, dtype=np.float32) for i in range(TENSORS)})


def _full_terminal() -> tuple[int, int]:
    """A pseudo-terminal ``(master, slave)`` whose output buffer is full: a process writing to the slave
    blocks until the master is read."""
    master, slave = pty.openpty()
    filler = os.open(os.ttyname(slave), os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        while True:
            os.write(filler, b"." * 4096)
    except BlockingIOError:
        pass
    finally:
        os.close(filler)
    return master, slave


def _drain(master: int, into: bytearray) -> None:
    """Read the terminal until every writer has gone (EIO)."""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            return
        if not data:
            return
        into.extend(data)


@pytest.mark.parametrize("restart", RESTARTS)
def test_a_daemon_killed_during_cuctx_load_is_said_so_at_once(workdir: Path, checkpoint: Path, restart: str) -> None:
    scene = Scene(workdir, "ipc", restart, SIM)
    master, slave = _full_terminal()
    cli = subprocess.Popen(
        [sys.executable, "-m", "cuctxd.client", "--endpoint", scene.endpoint, "--timeout", str(TIMEOUT), "load",
         str(checkpoint), "--name", "model"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=client_env(), cwd=REPO)
    os.close(slave)
    said = bytearray()
    try:
        with Client(scene.endpoint, timeout=TIMEOUT, name="observer", heartbeat=False) as observer:
            def allocated() -> bool:  # the layout's buffer is made before the first DMA, and so before progress
                return bool(observer.status()["devices"][0]["memory"]["allocated"] >= TENSORS * TENSOR_BYTES)

            assert wait_until(allocated, 30), "the load never allocated its buffer"
        assert cli.poll() is None, "the load finished before the kill (it must block on its progress line)"
        killed = scene.kill_and_restart()
        reader = threading.Thread(target=_drain, args=(master, said), name="terminal")
        reader.start()
        code = cli.wait(TIMEOUT + 10)
        exited = time.monotonic()
        reader.join(10)
        out = cli.stdout.read().decode() if cli.stdout is not None else ""
        text = said.decode(errors="replace").lstrip(".")
        lines = [line for line in text.split("\r\n") if line]  # a terminal's newlines
        assert code == 1 and not out, (code, out, lines)
        if lines and lines[0].startswith("\rloading "):  # the progress line, if it was shown before the error
            assert re.fullmatch(r"(\rloading .*: +\d+% \(.*\))+", lines.pop(0))
        assert "Traceback" not in text and len(lines) == 1, text[-3000:]
        assert lines[0].startswith(f"cuctx: CUCTXD_SESSION_LOST: {checkpoint}: the daemon went away during the load"), \
            lines[0]
        assert "BAD_ARGUMENT" not in lines[0], lines[0]
        assert exited - killed < AT_ONCE_S, f"cuctx load exited {exited - killed:.2f} s after the kill"
        if scene.replacement is not None:
            with Client(scene.endpoint, timeout=TIMEOUT, name="after") as after:
                assert after.status()["names"]["count"] == 0
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if cli.stdout is not None:
            cli.stdout.close()
        os.close(master)
        code = scene.close()
    assert code in (0, None), scene.replacement.log() if scene.replacement is not None else code
