"""The load profiler (``python -m bench.load_stages``) against a real sim daemon: every stage of a load is
timed, the stages fall within the load, and the load's functions are put back after it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.checkpoints import QUICK_MODEL, write_checkpoint
from bench.load_stages import Stages, instrumented, load_stages
from cuctxd import BadArgument, Client
from cuctxd.client.data_plane import file_reads
from cuctxd.client.tensors import safetensors_load
from cuctxd.protos import digests
from tests.helpers import REPO, DaemonProcess, client_env


def test_each_stage_of_a_load_is_timed_within_it(start_daemons: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = start_daemons("--sim-devices", "1")
    path = tmp_path / "model.safetensors"
    write_checkpoint(str(path), QUICK_MODEL)
    with Client(daemon.endpoint) as client:
        found = load_stages(client, str(path))
        assert client.list_shared() == [], "the layout is unpublished after the load"
    stages = found["stages"]
    assert {"read_checkpoint", "lookup", "host_alloc", "fill", "hash", "send:alloc", "wait:alloc",
            "send:memcpy_htod", "wait:memcpy_htod", "publish"} <= set(stages), sorted(stages)
    assert stages["send:memcpy_htod"]["count"] == stages["wait:memcpy_htod"]["count"] == stages["fill"]["count"]
    assert all(0 <= stage["first"] <= stage["last"] <= found["seconds"] for stage in stages.values())
    assert found["gbps"] > 0


def test_the_loads_functions_are_put_back(start_daemons: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemons("--sim-devices", "1")
    before = (safetensors_load._published, safetensors_load.publish_filled, file_reads._Reader._fill_buffered,
              file_reads._pipeline, digests.leaf, safetensors_load.read_checkpoint, file_reads._DirectRead.step)
    with Client(daemon.endpoint) as client:
        with instrumented(Stages(), client):
            assert file_reads._pipeline is not before[3] and "host_alloc" in vars(client)
        assert "host_alloc" not in vars(client)
    assert (safetensors_load._published, safetensors_load.publish_filled, file_reads._Reader._fill_buffered,
            file_reads._pipeline, digests.leaf, safetensors_load.read_checkpoint, file_reads._DirectRead.step) == before


def test_the_command_prints_a_line_per_load(start_daemons: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = start_daemons("--sim-devices", "1")
    path = tmp_path / "model.safetensors"
    write_checkpoint(str(path), QUICK_MODEL)
    done = subprocess.run([sys.executable, "-m", "bench.load_stages", daemon.endpoint, str(path), "--loads", "2",
                           "--no-digest"], capture_output=True, text=True, env=client_env(), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 2 and all("hash" not in line["stages"] for line in lines)


def test_a_failing_load_fails_the_same_way_when_timed(start_daemons: Callable[..., DaemonProcess],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = start_daemons("--sim-devices", "1")
    path = tmp_path / "model.safetensors"
    write_checkpoint(str(path), QUICK_MODEL)
    reads = file_reads._read_exactly

    def short_read(fd: int, into: memoryview, offset: int) -> None:
        if offset > 8 << 20:
            raise EOFError("the file ended early")
        reads(fd, into, offset)

    monkeypatch.setattr(file_reads, "_read_exactly", short_read)
    with Client(daemon.endpoint) as client:
        with pytest.raises(BadArgument, match="ended early"):
            load_stages(client, str(path))
        assert client.status()["devices"][0]["memory"]["allocated"] == 0, "the plan's cleanup ran"
        assert client.list_shared() == []
