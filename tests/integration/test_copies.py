"""A name's copies on several devices through a real daemon of 4 sim devices and the real CLI (issue 43): ``cuctx
load --device all`` and ``N,M`` put a copy on each, all published in one step; ``--device N`` adds a copy to a
name present elsewhere, filled from it and not from the files; ``cuctx shared`` lists every copy with its UUID;
``unpublish --device N`` removes one copy and ``unpublish`` all; a process that sees one device under
``CUCTXD_SIM_VISIBLE_DEVICES`` opens the copy on it, matched by UUID, or gets NO_COPY naming where copies are;
one device too full leaves nothing on the others; a replace swaps every copy at once, holders keeping theirs;
every copy is parked and adopted after a restart under the test service manager; a directory of tensor-parallel
ranks is a layout per rank, each on the device given for it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client
from cuctxd.client.tensors.copies import SIM_VISIBLE_DEVICES, ensure_copy
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.errors import NoCopy
from tests.checkpoint_files import write_shard
from tests.helpers import REPO, DaemonProcess, client_env, cuctx, remove_tempdir, short_tempdir, wait_until
from tests.integration.test_checkpoints import nothing_left, one_line_error
from tests.service_manager import ServiceManager

#: A checkpoint of about 4 MiB (the sim devices have 64 MiB each).
SIZE = 1 << 20


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "4", "--sim-memory", "64MiB")


def checkpoint(path: Path, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {"embed": rng.standard_normal(SIZE, dtype=np.float32), "ids": np.arange(5, dtype=np.int64)}
    write_shard(path, tensors, {"seed": str(seed)})
    return tensors


def load(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return cuctx("--endpoint", daemon.endpoint, "load", *args)


def copies(client: Client, name: str) -> list[dict[str, object]]:
    (record,) = [s for s in client.list_shared() if s["name"] == name]
    return list(record["copies"])


def all_freed(daemon: DaemonProcess) -> None:
    """Once the sessions that owned the buffers are gone: :func:`nothing_left`."""
    with Client(daemon.endpoint) as c:
        def freed() -> bool:
            return all(not d["shares"] and not d["memory"]["allocated"] for d in c.status()["devices"])

        assert wait_until(freed, 10)
        nothing_left(c)


def same_bytes(client: Client, name: str, device: int, tensors: dict[str, np.ndarray]) -> bool:
    with open_tensors(client, name, device=device) as opened:
        assert opened.share.descriptor.device == device
        return all(np.array_equal(np.asarray(opened[key]), array) for key, array in tensors.items())


def test_device_all_puts_a_copy_on_each_device_listed_with_its_uuid(daemon: DaemonProcess, tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "model.safetensors", 1)
    done = load(daemon, str(tmp_path / "model.safetensors"), "--name", "llama", "--device", "all")
    assert done.returncode == 0, done.stderr
    assert "on devices 0, 1, 2, 3 (a copy on each)" in done.stdout
    with Client(daemon.endpoint) as c:
        uuids = {d.index: d.uuid for d in c.devices()}
        listed = copies(c, "llama")
        assert [(x["device"], x["uuid"]) for x in listed] == sorted(uuids.items())
        assert len({x["share_id"] for x in listed}) == 4 and len({x["size"] for x in listed}) == 1
        digest = c.list_shared()[0]["digest"]
        for device in range(4):
            assert same_bytes(c, "llama", device, tensors)
            assert c.lookup("llama", device=device).device == device
            assert c.verify_shared("llama", digest, device)["verified"] == "publisher"
        table = cuctx("--endpoint", daemon.endpoint, "shared").stdout
        assert [re.match(r"llama +(\d) (GPU-\S+)", line).groups() for line in table.splitlines()[1:]] == [  # type: ignore[union-attr]
            (str(device), uuids[device][:12]) for device in range(4)]

        done = cuctx("--endpoint", daemon.endpoint, "unpublish", "llama", "--device", "2")
        assert done.returncode == 0 and "on device 2" in done.stdout, done.stderr
        assert [x["device"] for x in copies(c, "llama")] == [0, 1, 3]
        with pytest.raises(NoCopy, match=r"no copy on device 2; it has copies on device 0 \(GPU-.*1 \(.*3 \("):
            c.lookup("llama", device=2)
        done = cuctx("--endpoint", daemon.endpoint, "unpublish", "llama", "--device", "2")
        assert done.returncode == 1 and "CUCTXD_ERROR_NO_COPY" in done.stderr
        c.unpublish("llama")
        nothing_left(c)


def test_device_n_adds_a_copy_to_a_name_present_elsewhere_from_the_gpu(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = checkpoint(path, 2)
    assert load(daemon, str(path), "--name", "llama", "--device", "0").returncode == 0
    done = load(daemon, str(path), "--name", "llama", "--device", "1", "--json")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert not said["loaded"] and said["copied"] == [1]
    done = load(daemon, str(path), "--name", "llama", "--device", "0,1,3")
    assert "copied to device 3 from device 0 on the GPU" in done.stdout, done.stdout
    with Client(daemon.endpoint) as c:
        assert [x["device"] for x in copies(c, "llama")] == [0, 1, 3]
        for device in (0, 1, 3):
            assert same_bytes(c, "llama", device, tensors)
        assert ensure_copy(c, "llama", 3).device == 3  # there already: the same copy
        assert ensure_copy(c, "llama", 2).device == 2
        assert same_bytes(c, "llama", 2, tensors)
        c.unpublish("llama", device=0)  # the first copy goes: the next takes its place
        assert c.lookup("llama").device == 1
        c.unpublish("llama")
    all_freed(daemon)  # the copy ensure_copy made was that session's buffer, as a publish_tensors one is


OPEN_MINE = """
import sys
from cuctxd import Client
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.errors import NoCopy
with Client(ENDPOINT) as c:
    try:
        with open_tensors(c, "llama") as opened:
            print("opened", opened.share.descriptor.device, float(opened["embed"].__array_interface__["shape"][0]))
    except NoCopy as exc:
        print("NoCopy", exc.message)
"""


def open_as(daemon: DaemonProcess, visible: str | None) -> str:
    env = client_env()
    env.pop(SIM_VISIBLE_DEVICES, None)
    if visible is not None:
        env[SIM_VISIBLE_DEVICES] = visible
    done = subprocess.run([sys.executable, "-c", f"ENDPOINT = {daemon.endpoint!r}\n{OPEN_MINE}"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_process_that_sees_one_device_opens_the_copy_on_it_by_uuid(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    checkpoint(path, 3)
    assert load(daemon, str(path), "--name", "llama", "--device", "1,2").returncode == 0
    with Client(daemon.endpoint) as c:
        uuids = {d.index: d.uuid for d in c.devices()}
        assert open_as(daemon, uuids[2]) == f"opened 2 {float(SIZE)}"
        assert open_as(daemon, f"{uuids[1]},{uuids[0]}") == f"opened 1 {float(SIZE)}"  # the first is current
        assert open_as(daemon, "2") == f"opened 2 {float(SIZE)}"  # the daemon's ordinal
        said = open_as(daemon, uuids[3])
        assert said.startswith("NoCopy 'llama' has no copy on device 3; it has copies on device 1 "), said
        assert uuids[1] in said and uuids[2] in said
        assert open_as(daemon, None) == f"opened 1 {float(SIZE)}"  # no device of its own: the first copy
        c.unpublish("llama")
        nothing_left(c)


def test_device_all_with_one_device_too_full_leaves_nothing_on_the_others(daemon: DaemonProcess,
                                                                          tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    checkpoint(path, 4)
    with Client(daemon.endpoint, name="filler") as filler:
        free, _ = filler.mem_get_info(2)
        filled = filler.alloc(free - (2 << 20), 2)
        message = one_line_error(load(daemon, str(path), "--name", "llama", "--device", "all"))
        assert "CUDA_ERROR_OUT_OF_MEMORY" in message and "device 2 has no room for the copy of 'llama'" in message
        with Client(daemon.endpoint) as c:
            assert c.list_shared() == []
            status = c.status()
            assert all(device["shares"] == [] for device in status["devices"])
            assert [d["memory"]["allocated"] for d in status["devices"] if d["device"] != 2] == [0, 0, 0]
        filled.free()
    with Client(daemon.endpoint) as c:
        nothing_left(c)


def test_a_replace_swaps_every_copy_at_once_and_holders_keep_theirs(daemon: DaemonProcess, tmp_path: Path) -> None:
    old, new = checkpoint(tmp_path / "old.safetensors", 5), checkpoint(tmp_path / "new.safetensors", 6)
    assert load(daemon, str(tmp_path / "old.safetensors"), "--name", "llama", "--device", "0,1").returncode == 0
    with Client(daemon.endpoint) as c:
        held = open_tensors(c, "llama", device=1)
        done = load(daemon, str(tmp_path / "new.safetensors"), "--name", "llama", "--device", "0,1,2", "--replace")
        assert done.returncode == 0 and "replaced" in done.stdout, done.stderr
        assert [x["device"] for x in copies(c, "llama")] == [0, 1, 2]
        for device in (0, 1, 2):
            assert same_bytes(c, "llama", device, new)
        assert np.array_equal(np.asarray(held["embed"]), old["embed"])  # the old copy lives while held
        held.close()
        c.unpublish("llama")
        nothing_left(c)


def test_publish_tensors_on_several_devices_and_only_a_copy_of_the_same_layout(daemon: DaemonProcess) -> None:
    weights = {"w": np.arange(4096, dtype=np.float32)}
    with Client(daemon.endpoint) as c:
        first = publish_tensors(c, "small", weights, device=[3, 0])
        assert first.device == 3 and c.lookup("small").device == 3
        assert [x["device"] for x in copies(c, "small")] == [0, 3]
        assert same_bytes(c, "small", 0, weights)
        c.unpublish("small")
        publish_tensors(c, "everywhere", weights, device="all")
        assert [x["device"] for x in copies(c, "everywhere")] == [0, 1, 2, 3]
        c.unpublish("everywhere")
    all_freed(daemon)


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    directory = short_tempdir()
    service = ServiceManager(directory)
    yield service
    code = service.close()
    remove_tempdir(directory)
    assert code in (0, None), service.daemon.log() if service.daemon else ""


def test_every_copy_is_parked_and_comes_back_after_a_restart(manager: ServiceManager) -> None:
    """Each copy is a share parked on its own; a replace's staged copies are parked with the name once it brings
    them in (and the old copies leave the store); a SIGKILLed daemon's successor adopts every copy."""
    sim = ("--sim-devices", "4", "--sim-memory", "64MiB")
    daemon = manager.start(*sim)
    old = {"w": np.arange(4096, dtype=np.float32)}
    new = {"w": np.arange(4096, dtype=np.float32) * 2}
    with Client(daemon.endpoint, name="producer") as c:
        publish_tensors(c, "model", old, device=[0, 1])
    with Client(daemon.endpoint, name="producer, run again") as c:
        publish_tensors(c, "model", new, device=[1, 0, 3], replace=True)
        listed = copies(c, "model")
        digest = c.list_shared()[0]["digest"]
    parked = sorted(f"cuctxd-share-{x['share_id']}" for x in listed)
    manager.sync()
    assert sorted(name for name in manager.names() if name.startswith("cuctxd-share-")) == parked

    daemon = manager.restart(*sim)
    with Client(daemon.endpoint) as c:
        assert [(x["device"], x["share_id"]) for x in copies(c, "model")] == [(x["device"], x["share_id"])
                                                                             for x in listed]
        assert c.lookup("model").device in (0, 1, 3)  # whichever device adopted the name first
        for device in (0, 1, 3):
            with open_tensors(c, "model", device=device, digest=digest) as opened:
                assert np.array_equal(np.asarray(opened["w"]), new["w"])
        c.unpublish("model")
    manager.sync()
    assert [name for name in manager.names() if name.startswith("cuctxd-share-")] == []


OPEN_RANK = """
import sys
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors.ranks import open_rank
with Client(ENDPOINT) as c, open_rank(c, "tp", int(sys.argv[1])) as opened:
    print(opened.share.descriptor.device, sorted(opened), float(np.asarray(opened["w"]).sum()))
"""


def test_tensor_parallel_ranks_are_a_layout_each_on_the_device_given_for_it(daemon: DaemonProcess,
                                                                            tmp_path: Path) -> None:
    """vLLM's sharded_state: ``model-rank-R-part-P.safetensors``; ``NAME/rank-R`` on the R-th device given; a rank's
    process on that device opens its own by asking for its rank."""
    for rank in (0, 1):
        write_shard(tmp_path / f"model-rank-{rank}-part-0.safetensors", {"w": np.full(64, rank + 1, dtype=np.float32)})
        write_shard(tmp_path / f"model-rank-{rank}-part-1.safetensors", {"extra": np.arange(3, dtype=np.int64)})
    done = load(daemon, str(tmp_path), "--name", "tp", "--device", "2,3")
    assert done.returncode == 0, done.stderr
    assert "as 'tp/rank-0'" in done.stdout and "as 'tp/rank-1'" in done.stdout, done.stdout
    with Client(daemon.endpoint) as c:
        assert {s["name"]: s["device"] for s in c.list_shared()} == {"tp/rank-0": 2, "tp/rank-1": 3}
        uuids = {d.index: d.uuid for d in c.devices()}
        for rank, device in ((0, 2), (1, 3)):
            env = {**client_env(), SIM_VISIBLE_DEVICES: uuids[device]}
            said = subprocess.run([sys.executable, "-c", f"ENDPOINT = {daemon.endpoint!r}\n{OPEN_RANK}", str(rank)],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
            assert said.stdout.split(maxsplit=1) == [str(device), f"['extra', 'w'] {64.0 * (rank + 1)}\n"], said
        message = one_line_error(load(daemon, str(tmp_path), "--name", "tp2", "--device", "1"))
        assert "2 tensor-parallel ranks need 2 devices" in message
        for rank in (0, 1):
            c.unpublish(f"tp/rank-{rank}")
        assert load(daemon, str(tmp_path), "--name", "tp").returncode == 0  # by default rank R on device R
        assert {s["name"]: s["device"] for s in c.list_shared()} == {"tp/rank-0": 0, "tp/rank-1": 1}
        for rank in (0, 1):
            c.unpublish(f"tp/rank-{rank}")
        nothing_left(c)
