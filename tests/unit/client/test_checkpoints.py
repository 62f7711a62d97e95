"""Checkpoint resolution and every bad input (client/tensors/checkpoints.py), and the digests the client
computes (client/tensors/hashing.py, protos/layouts.py's digest fields), without a daemon."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from cuctxd.client.tensors.checkpoints import INDEX_NAME, MAX_HEADER_BYTES, read_checkpoint
from cuctxd.client.tensors.hashing import TASK_BYTES, hash_views
from cuctxd.client.tensors.publishing import layout_offsets
from cuctxd.protos import digests
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import Manifest, TensorSpec, check_manifest, stated_digest
from tests.checkpoint_files import write_index, write_shard


def sharded(tmp_path: Path) -> Path:
    write_shard(tmp_path / "model-00001-of-00002.safetensors",
                {"b": np.arange(3, dtype=np.int64), "a": np.ones((2, 2), dtype=np.float32)}, {"format": "pt"})
    write_shard(tmp_path / "model-00002-of-00002.safetensors", {"c": np.zeros(5, dtype=np.float16)})
    return tmp_path


# --- resolution -------------------------------------------------------------------------------


def test_a_single_file_is_one_shard_with_its_metadata_and_tensors_by_offset(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "one.safetensors", {"z": np.arange(4, dtype=np.float32),
                                                       "y": np.arange(2, dtype=np.uint8)}, {"format": "np"})
    checkpoint = read_checkpoint(str(path))
    assert [s.path for s in checkpoint.shards] == [str(path)] and checkpoint.metadata == {"format": "np"}
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors] == [
        ("z", "float32", (4,), 16), ("y", "uint8", (2,), 2)]
    start = len(path.read_bytes()) - 18
    assert [t.offset for t in checkpoint.tensors] == [start, start + 16]


def test_a_directory_without_an_index_takes_every_shard_sorted(tmp_path: Path) -> None:
    checkpoint = read_checkpoint(str(sharded(tmp_path)))
    assert [Path(s.path).name for s in checkpoint.shards] == ["model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors"]
    assert [(t.name, t.shard) for t in checkpoint.tensors] == [("b", 0), ("a", 0), ("c", 1)]
    assert checkpoint.nbytes == 24 + 16 + 10 and checkpoint.metadata == {"format": "pt"}


def test_a_directory_with_an_index_and_the_index_itself_read_the_same(tmp_path: Path) -> None:
    sharded(tmp_path)
    write_shard(tmp_path / "stray.safetensors", {"x": np.zeros(1, dtype=np.uint8)})  # not in the index
    write_index(tmp_path / INDEX_NAME, {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00001-of-00002.safetensors",
                                        "c": "model-00002-of-00002.safetensors"}, {"total_size": 50})
    by_dir, by_index = read_checkpoint(str(tmp_path)), read_checkpoint(str(tmp_path / INDEX_NAME))
    assert by_dir.tensors == by_index.tensors and by_dir.shards == by_index.shards
    assert [t.name for t in by_dir.tensors] == ["b", "a", "c"]
    assert by_dir.metadata == {"format": "pt", "total_size": 50}


# --- bad input: one BadArgument each, saying what and where ------------------------------------


def _bad(path: Path | str, *needles: str) -> None:
    with pytest.raises(BadArgument) as raised:
        read_checkpoint(str(path))
    message = str(raised.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_truncated_files(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "t.safetensors", {"w": np.arange(16, dtype=np.float32)})
    raw = path.read_bytes()
    path.write_bytes(raw[:5])
    _bad(path, "truncated", "not even")
    path.write_bytes(raw[:20])
    _bad(path, "truncated", "its header says")
    path.write_bytes(raw[:-1])
    _bad(path, "'w'", "truncated or its header lies")


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda h: h["w"].update(data_offsets=[0, 4096]), "truncated or its header lies"),
    (lambda h: h["w"].update(data_offsets=[8, 4]), "claims bytes 8..4"),
    (lambda h: h["w"].update(data_offsets=[-4, 60]), "data_offsets [-4, 60], not a list of"),
    (lambda h: h["w"].update(data_offsets=[0, 32]), "is 64 bytes, its offsets 0..32 say 32"),
    (lambda h: h["v"].update(data_offsets=[32, 40]), "overlap"),
    (lambda h: h["w"].update(dtype="F6_E2M3"), "dtype F6_E2M3, which layouts do not know"),
    (lambda h: h["w"].update(shape=[4, -1]), "shape [4, -1]"),
    (lambda h: h["w"].update(data_offsets=[0]), "is not [begin, end]"),
    (lambda h: h.update(extra=7), "'extra' is not a tensor"),
])
def test_a_header_that_lies(tmp_path: Path, edit: Any, needle: str) -> None:
    path = write_shard(tmp_path / "lies.safetensors", {"w": np.arange(16, dtype=np.float32),
                                                       "v": np.arange(8, dtype=np.uint8)}, edit=edit)
    _bad(path, str(path), needle)


def test_a_header_too_large_or_not_json(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    _bad(path, "larger than")
    path.write_bytes(struct.pack("<Q", 5) + b"{nope")
    _bad(path, "not JSON")
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    _bad(path, "not JSON", "expected '{'")


def test_a_path_that_is_not_there_or_a_directory_without_shards(tmp_path: Path) -> None:
    _bad(tmp_path / "missing.safetensors", "No such file")
    _bad(tmp_path, "without", INDEX_NAME)


def test_index_problems(tmp_path: Path) -> None:
    sharded(tmp_path)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = tmp_path / INDEX_NAME
    write_index(index, {"a": first, "b": first, "c": "model-00003-of-00002.safetensors"})
    _bad(tmp_path, "shard 'model-00003-of-00002.safetensors' named in the index is missing")
    write_index(index, {"a": first, "b": first, "c": second, "d": second})
    _bad(tmp_path, "the index puts tensor 'd'", "which does not have it")
    write_index(index, {"a": first, "c": second})
    _bad(tmp_path, "tensor 'b' is in", "but not in the index")
    write_index(index, {"a": first, "b": second, "c": second})
    _bad(tmp_path, "tensor 'b' is in", "the index puts it in")
    index.write_text("{not json")
    _bad(tmp_path, "the index is not JSON")
    index.write_text(json.dumps({"weight_map": ["a"]}))
    _bad(index, "'weight_map' maps tensor names to shard files")


def test_the_same_tensor_in_two_shards(tmp_path: Path) -> None:
    sharded(tmp_path)
    write_shard(tmp_path / "model-00003.safetensors", {"a": np.ones((2, 2), dtype=np.float32)})
    _bad(tmp_path, "tensor 'a' is in two shards")


# --- layout and digests ------------------------------------------------------------------------


def test_layout_offsets_align_every_tensor_even_an_empty_one() -> None:
    assert layout_offsets([1, 0, 256, 257]) == ([0, 256, 512, 768], 1280)
    assert layout_offsets([]) == ([], 256)


def test_hash_views_equals_tensor_digest_for_small_large_and_empty_views() -> None:
    rng = np.random.default_rng(7)
    large = rng.integers(0, 255, TASK_BYTES * 2 + digests.LEAF_BYTES // 3, dtype=np.uint8)
    views = [memoryview(large), memoryview(b""), memoryview(np.arange(10, dtype=np.float32)), memoryview(b"x")]
    assert hash_views(views, threads=3) == [digests.tensor_digest(v) for v in views]


def _manifest(**edits: Any) -> tuple[bytes, Manifest]:
    specs = (TensorSpec("a", "uint8", (4,), (1,), 0, digests.tensor_digest(b"abcd")),
             TensorSpec("b", "uint8", (2,), (1,), 256, digests.tensor_digest(b"xy")))
    manifest = Manifest.digested(specs, {})
    wire: dict[str, Any] = json.loads(json.dumps({"tensors": [t.to_wire() for t in specs], "metadata": {},
                                                  "digest": manifest.digest}))
    wire.update(edits)
    return msgpack.packb(wire), manifest


def test_manifest_digests_round_trip_and_are_checked() -> None:
    raw, manifest = _manifest()
    assert manifest.digest is not None and check_manifest(raw, 512).digest == manifest.digest
    assert stated_digest(raw) == manifest.digest and stated_digest(b"\xc1") is None
    assert check_manifest(manifest.pack(), 512) == manifest
    with pytest.raises(BadArgument, match="is not its tensors'"):
        check_manifest(_manifest(digest=digests.tensor_digest(b"other"))[0], 512)
    with pytest.raises(BadArgument, match="'digest' must be xxh3-128"):
        check_manifest(_manifest(digest="md5:00")[0], 512)
    wire = msgpack.unpackb(_manifest()[0])
    wire["tensors"][0]["digest"] = "xxh3-128:XYZ"
    with pytest.raises(BadArgument, match="tensor 'a': 'digest'"):
        check_manifest(msgpack.packb(wire), 512)
    del wire["tensors"][0]["digest"]
    with pytest.raises(BadArgument, match="not every tensor has a digest"):
        check_manifest(msgpack.packb(wire), 512)
    del wire["digest"]
    assert check_manifest(msgpack.packb(wire), 512).digest is None  # an old manifest stays valid
