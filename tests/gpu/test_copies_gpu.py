"""A name's copies on several GPUs, and the copy on the caller's own GPU, on the cuda backend (issue 43).

With one GPU: a process finds its GPU by UUID (the driver's current context, torch's current device, and under
``CUDA_VISIBLE_DEVICES=<uuid>``) and opens the copy there. With two or more (skipped with "needs two devices"
otherwise): ``cuctx load --device all`` puts a copy on each, filled from the first by a peer copy; a process
that sees only GPU 1 under ``CUDA_VISIBLE_DEVICES`` opens the copy on it; ``ensure_copy`` of a 1 GiB layout
prints its peer-copy rate."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client
from cuctxd.client.tensors.copies import ensure_copy
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from tests.checkpoint_files import write_shard
from tests.helpers import REPO, DaemonProcess, client_env, cuctx

OPEN_MINE = """
import sys
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors.copies import caller_device
from cuctxd.client.tensors.tensor_sets import open_tensors
if sys.argv[1] == "torch":
    import torch
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
with Client(ENDPOINT) as c, open_tensors(c, NAME) as opened:
    data = np.frombuffer(opened.share.read(opened["w"].nbytes, opened["w"].spec.offset), dtype=np.float32)
    print("opened", caller_device(c), opened.share.descriptor.device, opened.share.descriptor.device_uuid,
          float(data.sum()), flush=True)
"""


def open_as(daemon: DaemonProcess, name: str, visible: str | None, flavour: str = "driver") -> list[str]:
    env = client_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    script = f"ENDPOINT = {daemon.endpoint!r}\nNAME = {name!r}\n{OPEN_MINE}"
    done = subprocess.run([sys.executable, "-c", script, flavour], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stdout.splitlines() if line.startswith("opened")).split()[1:]


def test_a_process_opens_the_copy_on_its_own_gpu_by_uuid(cuda_daemon: DaemonProcess) -> None:
    weights = {"w": np.arange(1 << 16, dtype=np.float32)}
    expected = str(float(weights["w"].sum()))
    with Client(cuda_daemon.endpoint) as c:
        uuid = c.devices()[0].uuid
        publish_tensors(c, "mine", weights, device=0)
        try:
            assert open_as(cuda_daemon, "mine", None) == ["0", "0", uuid, expected]
            assert open_as(cuda_daemon, "mine", uuid) == ["0", "0", uuid, expected]
            if importlib.util.find_spec("torch") is not None:
                assert open_as(cuda_daemon, "mine", uuid, "torch") == ["0", "0", uuid, expected]
        finally:
            c.unpublish("mine")


def two_devices(daemon: DaemonProcess) -> list[str]:
    with Client(daemon.endpoint) as c:
        uuids = [d.uuid for d in c.devices()]
    if len(uuids) < 2:
        pytest.skip("needs two devices")
    return uuids


def test_device_all_fills_each_gpu_and_a_process_seeing_gpu_1_opens_its_copy(cuda_daemon: DaemonProcess,
                                                                            tmp_path: Path) -> None:
    uuids = two_devices(cuda_daemon)
    weights = {"w": np.random.default_rng(0).standard_normal(1 << 22, dtype=np.float32)}
    write_shard(tmp_path / "model.safetensors", weights)
    done = cuctx("--endpoint", cuda_daemon.endpoint, "load", str(tmp_path / "model.safetensors"), "--name", "all",
                 "--device", "all", timeout=300)
    assert done.returncode == 0, done.stderr
    with Client(cuda_daemon.endpoint) as c:
        try:
            assert [x["uuid"] for x in next(s for s in c.list_shared() if s["name"] == "all")["copies"]] == uuids
            for device in range(len(uuids)):
                with open_tensors(c, "all", device=device) as opened:
                    raw = opened.share.read(weights["w"].nbytes, opened["w"].spec.offset)
                    assert np.array_equal(np.frombuffer(raw, dtype=np.float32), weights["w"]), device
            said = open_as(cuda_daemon, "all", uuids[1])
            assert said[:3] == ["1", "1", uuids[1]], said  # its ordinal 0 is the daemon's 1: matched by UUID
        finally:
            c.unpublish("all")


def test_ensure_copy_peer_copies_a_gib_layout(cuda_daemon: DaemonProcess) -> None:
    two_devices(cuda_daemon)
    weights = {"w": np.arange(1 << 28, dtype=np.float32)}  # 1 GiB
    with Client(cuda_daemon.endpoint) as c:
        publish_tensors(c, "gib", weights, device=0)
        try:
            started = time.perf_counter()
            copy = ensure_copy(c, "gib", 1)
            took = time.perf_counter() - started
            print(f"ensure_copy of 1 GiB from device 0 to 1: {took:.3f} s, {(1 << 30) / took / 1e9:.1f} GB/s")
            assert copy.device == 1
            with open_tensors(c, "gib", device=1) as opened:
                tail = opened.share.read(1 << 20, opened["w"].nbytes - (1 << 20))
                assert np.array_equal(np.frombuffer(tail, dtype=np.float32), weights["w"][-(1 << 18):])
        finally:
            c.unpublish("gib")
