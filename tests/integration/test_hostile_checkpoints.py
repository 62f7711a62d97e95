"""Hostile checkpoints (issue 41) through the real ``cuctx load`` against a real sim daemon: a FIFO among the
shards, a header nested 100,000 deep, an index entry outside the directory, a 56 MB header of empty tensors
and a checkpoint no layout can hold each end in one line naming the file, exit status 1 and nothing
published or allocated; a Hugging Face cache snapshot (files linked into ``../../blobs``) loads."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client
from cuctxd.client.tensors.safetensors_load import load_safetensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import MAX_TENSORS
from tests.checkpoint_files import hf_snapshot, write_index, write_raw_shard, write_shard, zero_size_header
from tests.helpers import DaemonProcess
from tests.integration.test_checkpoints import expected_digest, load, nothing_left, one_line_error

pytestmark = pytest.mark.timeout(120)


def _fifo_shard(root: Path) -> Path:
    write_shard(root / "a.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    os.mkfifo(root / "x.safetensors")  # before: the open waited for a writer forever
    return root


def _deep(root: Path) -> Path:
    return write_raw_shard(root / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)  # before: RecursionError


def _outside(root: Path) -> Path:
    write_shard(root / "outside.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    (root / "inner").mkdir()
    return write_index(root / "inner" / "model.safetensors.index.json", {"w": "../outside.safetensors"}).parent


def _linked_folder(root: Path) -> Path:
    write_shard(root / "outside.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    (root / "inner").mkdir()
    (root / "inner" / "up").symlink_to("..")
    return write_index(root / "inner" / "model.safetensors.index.json", {"w": "up/outside.safetensors"}).parent


def _zeros(root: Path) -> Path:
    return write_raw_shard(root / "zeros.safetensors", zero_size_header(1_000_000))  # 56 MB


def _too_many_for_a_layout(root: Path) -> Path:
    return write_raw_shard(root / "many.safetensors", zero_size_header(20_000))  # a manifest above 512 KiB


HOSTILE: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "a FIFO among the shards": (_fifo_shard, "x.safetensors", "not a regular file (a FIFO)"),
    "a header nested 100,000 deep": (_deep, "deep.safetensors", "expected '{'"),
    "an index entry outside the directory": (_outside, "model.safetensors.index.json",
                                             "shard '../outside.safetensors' is not a file name in the index's"),
    "a symlinked folder out of the directory": (_linked_folder, "model.safetensors.index.json",
                                                "outside the index's directory"),
    "a 56 MB header of empty tensors": (_zeros, "zeros.safetensors", f"lists more than {MAX_TENSORS} tensors"),
    "more tensors than a layout holds": (_too_many_for_a_layout, "many.safetensors", "a manifest of"),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_hostile_checkpoint_is_one_line_naming_the_file_and_leaves_nothing(daemon: DaemonProcess, tmp_path: Path,
                                                                             hostile: str) -> None:
    make, file, needle = HOSTILE[hostile]
    line = one_line_error(load(daemon, str(make(tmp_path)), "--name", "hostile"))
    assert "CUCTXD_ERROR_BAD_ARGUMENT" in line and file in line and needle in line, line
    with Client(daemon.endpoint) as c:
        nothing_left(c)


def test_a_hugging_face_snapshot_loads_through_its_links(daemon: DaemonProcess, tmp_path: Path) -> None:
    first = {"embed": np.arange(12, dtype=np.float32).reshape(3, 4)}
    second = {"norm": np.ones(5, dtype=np.float16)}
    snapshot = hf_snapshot(tmp_path, {"model-00001-of-00002.safetensors": first,
                                      "model-00002-of-00002.safetensors": second})
    for path, name in ((snapshot, "snap"), (snapshot / "model.safetensors.index.json", "snap-index")):
        done = load(daemon, str(path), "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["digest"] == expected_digest({**first, **second})
    with Client(daemon.endpoint) as c:
        with open_tensors(c, "snap") as opened:
            assert np.array_equal(np.asarray(opened["embed"]), first["embed"])
        c.unpublish("snap")
        c.unpublish("snap-index")
        nothing_left(c)


def test_the_client_raises_the_same_named_error(client: Client, tmp_path: Path) -> None:
    with pytest.raises(BadArgument, match=r"x\.safetensors: not a regular file"):
        load_safetensors(client, str(_fifo_shard(tmp_path)), "hostile")
    nothing_left(client)
