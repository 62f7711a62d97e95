"""Checkpoints through a real daemon and the real CLI (issue 28): a sharded directory or an index loads as
one layout with its bytes and digests; a consumer can require a digest; the same content under a taken name
is a no-op (with --replace too), other content is refused unless replaced, only whoever may unpublish the
name may replace it, and a replace leaves old holders their bytes; every
bad input is one line and leaves nothing published or allocated, a device without room included."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cuctxd import Client, DigestMismatch, NameExists, NotOwner
from cuctxd.client.tensors.publishing import layout_offsets, publish_tensors
from cuctxd.client.tensors.safetensors_load import load_safetensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos import digests
from tests.checkpoint_files import write_index, write_shard
from tests.helpers import DaemonProcess, cuctx, tcp_endpoint

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "64MiB")


def tensors_of(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two shards' tensors; a large one spans several digest leaves."""
    rng = np.random.default_rng(seed)
    first = {"embed": rng.standard_normal((1024, 1536), dtype=np.float32), "ids": np.arange(7, dtype=np.int64)}
    second = {"norm": rng.standard_normal(33).astype(np.float16), "empty": np.zeros((0, 4), dtype=np.float32)}
    return first, second


def checkpoint(directory: Path, seed: int = 1, index: bool = True) -> dict[str, np.ndarray]:
    """A two-shard checkpoint in ``directory`` (with its index unless not ``index``); all its tensors."""
    directory.mkdir(exist_ok=True)
    first, second = tensors_of(seed)
    write_shard(directory / FIRST, first, {"format": "np"})
    write_shard(directory / SECOND, second)
    if index:
        write_index(directory / "model.safetensors.index.json", {**dict.fromkeys(first, FIRST),
                                                                 **dict.fromkeys(second, SECOND)}, {"total": 1})
    return {**first, **second}


def load(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return cuctx("--endpoint", daemon.endpoint, "load", *args)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and not done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def nothing_left(client: Client) -> None:
    """No name, no share and no allocated byte on any device (what a failed load must leave)."""
    status = client.status()
    assert status["names"]["count"] == 0, client.list_shared()
    for device in status["devices"]:
        assert device["shares"] == [] and device["memory"]["allocated"] == 0, device


def expected_digest(tensors: dict[str, np.ndarray]) -> str:
    names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64"}
    return digests.layout_digest((name, names[array.dtype], array.shape, digests.tensor_digest(array.tobytes()))
                                 for name, array in tensors.items())


def test_a_sharded_directory_and_its_index_load_as_one_layout_with_digests(daemon: DaemonProcess,
                                                                           tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "model")
    done = load(daemon, str(tmp_path / "model"), "--name", "sharded")
    assert done.returncode == 0, done.stderr
    assert "published" in done.stdout and digests.short(expected_digest(tensors)) in done.stdout
    index = load(daemon, str(tmp_path / "model" / "model.safetensors.index.json"), "--name", "by-index", "--json")
    assert index.returncode == 0, index.stderr
    assert json.loads(index.stdout)["digest"] == expected_digest(tensors)
    with Client(daemon.endpoint) as c:
        for name in ("sharded", "by-index"):
            with open_tensors(c, name) as ts:
                assert ts.digest == expected_digest(tensors) and ts.metadata == {"format": "np", "total": 1}
                assert list(ts) == ["embed", "ids", "norm", "empty"]  # by shard, then by offset
                for key, array in tensors.items():
                    assert np.array_equal(np.asarray(ts[key]), array), key
                    assert ts[key].spec.digest == digests.tensor_digest(array.tobytes()), key
        listed = {s["name"]: s["digest"] for s in c.list_shared()}
        assert listed == {"sharded": expected_digest(tensors), "by-index": expected_digest(tensors)}
        table = cuctx("--endpoint", daemon.endpoint, "shared").stdout
        assert re.search(rf"sharded .* {digests.short(expected_digest(tensors))} +[0-9a-f]{{32}}", table), table
        shared_json = json.loads(cuctx("--endpoint", daemon.endpoint, "shared", "--json").stdout)
        assert {s["digest"] for s in shared_json} == {expected_digest(tensors)}
        c.unpublish("sharded")
        c.unpublish("by-index")


def test_a_directory_without_an_index_loads_every_shard(daemon: DaemonProcess, tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "plain", seed=2, index=False)
    with Client(daemon.endpoint) as c:
        seen: list[tuple[int, int]] = []
        loaded = load_safetensors(c, str(tmp_path / "plain"), "no-index", progress=lambda d, t: seen.append((d, t)))
        assert loaded.loaded and loaded.digest == expected_digest(tensors)
        total = sum(a.nbytes for a in tensors.values())
        assert seen and seen[-1] == (total, total) and {t for _, t in seen} == {total}  # one progress for all
        c.unpublish("no-index")


def test_a_consumer_can_require_a_digest(daemon: DaemonProcess, tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "model", seed=3)
    with Client(daemon.endpoint) as c:
        load_safetensors(c, str(tmp_path / "model"), "required")
        with open_tensors(c, "required", digest=expected_digest(tensors)) as ts:
            assert ts.digest == expected_digest(tensors)
        other = expected_digest(checkpoint(tmp_path / "other", seed=4))
        with pytest.raises(DigestMismatch) as raised:
            open_tensors(c, "required", digest=other)
        assert other in str(raised.value) and expected_digest(tensors) in str(raised.value)
        assert raised.value.name == "CUCTXD_ERROR_DIGEST_MISMATCH"
        host = {"w": np.arange(6, dtype=np.float32)}
        publish_tensors(c, "from-host", host)
        with open_tensors(c, "from-host", digest=expected_digest(host)) as ts:
            assert ts["w"].spec.digest == digests.tensor_digest(host["w"].tobytes())
        publish_tensors(c, "undigested", host, digest=False)
        with pytest.raises(DigestMismatch, match="without a digest"):
            open_tensors(c, "undigested", digest=expected_digest(host))
        assert all(s["holders"] == 0 for s in c.list_shared()), "a refused open left a hold"
        for name in ("required", "from-host", "undigested"):
            c.unpublish(name)


def test_the_same_content_is_a_no_op_and_other_content_is_refused(daemon: DaemonProcess, tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "model", seed=5)
    assert load(daemon, str(tmp_path / "model"), "--name", "taken").returncode == 0
    with Client(daemon.endpoint) as c:
        before = c.status()["devices"][0]["shares"]
        again = load(daemon, str(tmp_path / "model" / "model.safetensors.index.json"), "--name", "taken")
        assert again.returncode == 0, again.stderr
        assert f"already loaded: same content, digest {expected_digest(tensors)}" in again.stdout
        assert c.status()["devices"][0]["shares"] == before, "the no-op allocated or published something"
        checkpoint(tmp_path / "other", seed=6)
        line = one_line_error(load(daemon, str(tmp_path / "other"), "--name", "taken"))
        assert "CUCTXD_ERROR_NAME_EXISTS" in line and "other content" in line and "--replace" in line
        with pytest.raises(NameExists, match="other content"):
            load_safetensors(c, str(tmp_path / "other"), "taken")
        same = load_safetensors(c, str(tmp_path / "model"), "taken")
        assert not same.loaded and same.digest == expected_digest(tensors) and same.descriptor.name == "taken"
        assert c.status()["devices"][0]["shares"] == before
        c.unpublish("taken")


@pytest.mark.parametrize("device", ["0", "1"], ids=["same device", "another device"])
def test_replace_swaps_the_name_and_old_holders_keep_their_bytes(daemon: DaemonProcess, tmp_path: Path,
                                                                 device: str) -> None:
    old = checkpoint(tmp_path / "v1", seed=7)
    new = checkpoint(tmp_path / "v2", seed=8)
    assert load(daemon, str(tmp_path / "v1"), "--name", "swapped").returncode == 0
    with Client(daemon.endpoint) as holder:
        held = open_tensors(holder, "swapped")
        done = load(daemon, str(tmp_path / "v2"), "--name", "swapped", "--replace", "--device", device)
        assert done.returncode == 0 and "replaced" in done.stdout, done.stderr
        with Client(daemon.endpoint) as newcomer, open_tensors(newcomer, "swapped") as fresh:
            assert fresh.digest == expected_digest(new) and np.array_equal(np.asarray(fresh["embed"]), new["embed"])
        shares = holder.status()["devices"]
        again = load(daemon, str(tmp_path / "v2"), "--name", "swapped", "--replace", "--device", device)
        assert again.returncode == 0 and "already loaded: same content" in again.stdout, again.stderr
        assert holder.status()["devices"] == shares, "a replace with the same content allocated or swapped"
        fresh_name = load(daemon, str(tmp_path / "v1"), "--name", "not-taken", "--replace", "--json")
        assert json.loads(fresh_name.stdout)["replaced"] is False, fresh_name.stderr
        holder.unpublish("not-taken")
        assert held.digest == expected_digest(old) and np.array_equal(np.asarray(held["embed"]), old["embed"])
        shares = [s for d in holder.status()["devices"] for s in d["shares"]]
        assert sorted(len(s["names"]) for s in shares) == [0, 1], "the old share keeps no name, the new one has it"
        held.close()
        shares = [s for d in holder.status()["devices"] for s in d["shares"]]
        assert [s["names"] for s in shares] == [["swapped"]], "the old buffer went with its last holder"
        assert [s["device"] for s in holder.list_shared()] == [int(device)]
        holder.unpublish("swapped")
        nothing_left(holder)


def _truncated(root: Path) -> Path:
    path = root / FIRST
    path.write_bytes(path.read_bytes()[:-100])
    return root


def _edit_first(root: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    first, _ = tensors_of(1)
    write_shard(root / FIRST, first, edit=edit)
    return root


BAD_INPUTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated": (_truncated, "truncated or its header lies"),
    "lying offsets": (lambda r: _edit_first(r, lambda h: h["ids"].update(data_offsets=[0, 56])), "overlap"),
    "wrong size": (lambda r: _edit_first(r, lambda h: h["ids"].update(shape=[8])), "the header lies"),
    "missing shard": (lambda r: (r / SECOND).unlink() or r, "named in the index is missing"),
    "unknown dtype": (lambda r: _edit_first(r, lambda h: h["ids"].update(dtype="F6_E2M3")),
                      "dtype F6_E2M3, which layouts do not know"),
    "not in the index": (lambda r: write_index(r / "model.safetensors.index.json",
                                               {"embed": FIRST, "norm": SECOND, "empty": SECOND}).parent,
                         "'ids' is in"),
    "header not json": (lambda r: (r / FIRST).write_bytes(b"\x04" + bytes(7) + b"{bad") and r, "not JSON"),
}


@pytest.mark.parametrize("damage", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_leaves_nothing(daemon: DaemonProcess, tmp_path: Path, damage: str) -> None:
    checkpoint(tmp_path / "model")
    spoil, needle = BAD_INPUTS[damage]
    line = one_line_error(load(daemon, str(spoil(tmp_path / "model")), "--name", "damaged"))
    assert "CUCTXD_ERROR_BAD_ARGUMENT" in line and needle in line, line
    with Client(daemon.endpoint) as c:
        nothing_left(c)


def test_a_device_without_room_is_one_line_and_leaves_nothing(start_daemons: Callable[..., DaemonProcess],
                                                              tmp_path: Path) -> None:
    small = start_daemons("--sim-devices", "1", "--sim-memory", "4MiB")
    _, size = layout_offsets(array.nbytes for array in checkpoint(tmp_path / "model").values())  # 6 MiB
    line = one_line_error(load(small, str(tmp_path / "model"), "--name", "too-big"))
    assert "CUDA_ERROR_OUT_OF_MEMORY" in line and f"needs 6.0 MiB ({size} bytes)" in line, line
    with Client(small.endpoint) as c:
        nothing_left(c)


def test_only_who_may_unpublish_a_name_may_replace_it(start_daemons: Callable[..., DaemonProcess],
                                                     tmp_path: Path) -> None:
    started = start_daemons("--sim-devices", "1", "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")
    tensors = checkpoint(tmp_path / "v1", seed=9)
    checkpoint(tmp_path / "v2", seed=10)
    with Client(started.endpoint) as owner, Client(tcp_endpoint(started)) as stranger:
        load_safetensors(owner, str(tmp_path / "v1"), "owned")
        with pytest.raises(NotOwner):  # tcp://: its uid is unknown, so not the publisher's user
            load_safetensors(stranger, str(tmp_path / "v2"), "owned", replace=True)
        with open_tensors(owner, "owned") as still:
            assert still.digest == expected_digest(tensors)
        assert [s["names"] for d in owner.status()["devices"] for s in d["shares"]] == [["owned"]], \
            "the refused replace left a buffer behind"
        owner.unpublish("owned")
