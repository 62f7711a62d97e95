"""Hostile checkpoints (issue 41) against the reader alone (client/tensors/checkpoints.py and
safetensors_header.py): what is not a regular file, headers nested deep, huge or of a million empty tensors,
index entries that leave the directory; each refused with one BadArgument line naming the file, at a cost
the limits bound. A Hugging Face cache snapshot, whose files are links into ``../../blobs``, still reads."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cuctxd.client.tensors.checkpoints import INDEX_NAME, MAX_HEADER_BYTES, MAX_INDEX_BYTES, read_checkpoint
from cuctxd.client.tensors.safetensors_header import FIRST_READ, parse_header
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import MAX_DIMS, MAX_NAME_CHARS, MAX_TENSORS
from tests.checkpoint_files import hf_snapshot, write_index, write_raw_shard, write_shard, zero_size_header

pytestmark = pytest.mark.timeout(60)  # a FIFO opened blocking waits for a writer forever: fail instead


def _bad(path: Path | str, *needles: str) -> str:
    with pytest.raises(BadArgument) as raised:
        read_checkpoint(str(path))
    message = str(raised.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def _tensor_header(**entry: Any) -> bytes:
    return json.dumps({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], **entry}}).encode()


# --- item 3: only regular files ----------------------------------------------------------------


def test_a_fifo_among_the_shards_is_refused_without_blocking(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    os.mkfifo(tmp_path / "x.safetensors")
    _bad(tmp_path, str(tmp_path / "x.safetensors"), "not a regular file (a FIFO)")
    _bad(tmp_path / "x.safetensors", "not a regular file (a FIFO)")


def test_a_fifo_or_a_directory_as_the_index_or_a_shard_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / INDEX_NAME)
    _bad(tmp_path, INDEX_NAME, "not a regular file (a FIFO)")
    (tmp_path / INDEX_NAME).unlink()
    (tmp_path / INDEX_NAME).mkdir()
    _bad(tmp_path, INDEX_NAME, "not a regular file (a directory)")
    (tmp_path / INDEX_NAME).rmdir()
    (tmp_path / "dir.safetensors").mkdir()
    os.mkfifo(tmp_path / "fifo.safetensors")
    write_index(tmp_path / INDEX_NAME, {"a": "dir.safetensors"})
    _bad(tmp_path, "dir.safetensors: not a regular file (a directory)")
    write_index(tmp_path / INDEX_NAME, {"a": "fifo.safetensors"})
    _bad(tmp_path, "fifo.safetensors: not a regular file (a FIFO)")
    _bad("/dev/null", "/dev/null: not a regular file (a character device)")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "sock.safetensors"))
        write_index(tmp_path / INDEX_NAME, {"a": "sock.safetensors"})
        _bad(tmp_path, "sock.safetensors: No such device or address")


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    (tmp_path / "loop.safetensors").symlink_to("loop.safetensors")
    _bad(tmp_path, "loop.safetensors", "Too many levels of symbolic links")
    write_index(tmp_path / INDEX_NAME, {"a": "loop.safetensors"})
    _bad(tmp_path, "loop.safetensors", "Too many levels of symbolic links")


# --- item 4: nesting -----------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "needle"), [
    (b"[" * 100_000 + b"]" * 100_000, "expected '{'"),
    (b'{"w":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001, "the key 'a', which safetensors does not know"),
    (b'{"w":{"dtype":"U8","shape":' + b"[" * 100_000 + b"]" * 100_000 + b',"data_offsets":[0,0]}}',
     "shape [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[], not a list of"),
    (b'{"__metadata__":{"k":' + b"[" * 100_000 + b"]" * 100_000 + b"}}", "expected a string (__metadata__"),
], ids=["arrays", "objects", "in a shape", "in the metadata"])
def test_a_header_nested_100000_deep_is_one_line(tmp_path: Path, header: bytes, needle: str) -> None:
    _bad(write_raw_shard(tmp_path / "deep.safetensors", header), "deep.safetensors", needle)


def test_an_index_nested_100000_deep_is_one_line(tmp_path: Path) -> None:
    (tmp_path / INDEX_NAME).write_bytes(b'{"metadata":{"k":' + b"[" * 100_000 + b"]" * 100_000 + b"}}")
    _bad(tmp_path, INDEX_NAME, "expected a string, a number, true, false or null")


# --- item 5: index entries stay in the directory -------------------------------------------------


def test_an_index_entry_outside_its_directory_is_refused(tmp_path: Path) -> None:
    write_shard(tmp_path / "outside.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    inner = tmp_path / "inner"
    inner.mkdir()
    for entry in ["../outside.safetensors", str(tmp_path / "outside.safetensors"), "a/../../outside.safetensors",
                  "new\nline.safetensors", ".", ""]:
        write_index(inner / INDEX_NAME, {"w": entry})
        _bad(inner, INDEX_NAME, f"shard {entry!r} is not a file name in the index's directory")


def test_a_symlinked_folder_that_leaves_the_directory_is_refused(tmp_path: Path) -> None:
    write_shard(tmp_path / "outside.safetensors", {"w": np.arange(4, dtype=np.uint8)})
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "up").symlink_to("..")
    write_index(inner / INDEX_NAME, {"w": "up/outside.safetensors"})
    _bad(inner, "shard 'up/outside.safetensors' is in", "outside the index's directory")


def test_a_hugging_face_snapshot_whose_files_link_to_blobs_reads(tmp_path: Path) -> None:
    weights = {"a": np.arange(6, dtype=np.float32)}
    snapshot = hf_snapshot(tmp_path, {"model-00001-of-00002.safetensors": weights,
                                      "model-00002-of-00002.safetensors": {"b": np.ones(3, dtype=np.uint8)}})
    for path in (snapshot, snapshot / INDEX_NAME):
        checkpoint = read_checkpoint(str(path))
        assert [(t.name, t.shape) for t in checkpoint.tensors] == [("a", (6,)), ("b", (3,))]
        assert [Path(s.path).parent for s in checkpoint.shards] == [snapshot, snapshot]
    (snapshot / "sub").mkdir()
    (snapshot / "sub" / "c.safetensors").symlink_to("../../../blobs/blob0")
    write_index(snapshot / INDEX_NAME, {"a": "sub/c.safetensors"})  # a folder inside: its file may link out
    assert [t.name for t in read_checkpoint(str(snapshot)).tensors] == ["a"]
    os.unlink(tmp_path / "blobs" / "blob0")  # the link left dangling: missing
    _bad(snapshot, "sub/c.safetensors", "No such file or directory")


# --- item 6 and the other bounds -----------------------------------------------------------------


def test_a_million_zero_size_tensors_are_refused_at_the_limit_having_read_little(tmp_path: Path) -> None:
    header = zero_size_header(1_000_000)  # 56 MB: the header (before: parsed whole, 1 GB, 13 s)
    _bad(write_raw_shard(tmp_path / "zeros.safetensors", header), "zeros.safetensors",
         f"lists more than {MAX_TENSORS} tensors")
    read = []

    def counting(n: int) -> bytes:
        read.append(n)
        return header[sum(read) - n:sum(read)]

    with pytest.raises(BadArgument, match=f"more than {MAX_TENSORS} tensors"):
        parse_header("zeros.safetensors", counting, len(header), MAX_TENSORS)
    refused_at = len(zero_size_header(MAX_TENSORS + 1))
    assert sum(read) <= max(2 * refused_at, FIRST_READ) < len(header) // 4, "read on past the refusal"


def test_the_tensor_limit_counts_every_shard(tmp_path: Path) -> None:
    half = MAX_TENSORS // 2 + 1
    write_raw_shard(tmp_path / "a.safetensors", zero_size_header(half))
    write_raw_shard(tmp_path / "b.safetensors", zero_size_header(half).replace(b'"t', b'"u'))
    _bad(tmp_path, "b.safetensors", f"lists more than {MAX_TENSORS - half} tensors")


@pytest.mark.parametrize(("header", "needle"), [
    (json.dumps({"x" * (MAX_NAME_CHARS + 1): {}}).encode(), f"1 to {MAX_NAME_CHARS}"),
    (json.dumps({"": {}}).encode(), "0 characters"),
    (_tensor_header(shape=[1] * (MAX_DIMS + 1)), f"not a list of at most {MAX_DIMS} integers"),
    (_tensor_header(shape=[1.0, 4]), "shape [1.0, 4]"),
    (_tensor_header(shape=[10 ** 20]), "shape [100000000000000000000]"),
    (_tensor_header(shape=[0, 2 ** 40, 2 ** 40]), "spans more than 2^63 bytes"),
    (_tensor_header(extra=1), "the key 'extra', which safetensors does not know"),
    (json.dumps({"w": {"dtype": "U8", "shape": [4]}}).encode(), "it lacks data_offsets"),
    (b'{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{}}', "has the key 'w' twice"),
    (b'{"w":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}}', "has the key 'dtype' twice"),
    (b'{"__metadata__":{"a":"1","a":"2"}}', "has the key 'a' twice"),
    (b'{"__metadata__":{"a":1}}', "expected a string (__metadata__ maps strings to strings)"),
    (b'{"w\xff":{}}', "holds a string that is not UTF-8 text"),
    (b'{"w\\ud800":{}}', "holds a string that is not UTF-8 text"),
    (b'{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}} x', "expected the end"),
    (b'{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}', "expected ',' or '}', found its end"),
    (b"\xef\xbb\xbf{}", "expected '{'"),
], ids=["long name", "empty name", "dims", "float dim", "dim past u64", "strides past 2^63", "unknown key",
        "missing key", "tensor twice", "dtype twice", "metadata key twice", "metadata not strings", "not UTF-8",
        "lone surrogate", "trailing junk", "unterminated", "byte order mark"])
def test_a_hostile_header_is_one_line(tmp_path: Path, header: bytes, needle: str) -> None:
    _bad(write_raw_shard(tmp_path / "h.safetensors", header, b"\0" * 4), "h.safetensors", needle)


def test_a_header_padded_with_spaces_and_escaped_names_reads(tmp_path: Path) -> None:
    header = b'{"__metadata__":null, "w\\u00e9\\n" : {"data_offsets":[0,4],"shape":[ 4 ],"dtype":"U8"}}' + b" " * 9
    checkpoint = read_checkpoint(str(write_raw_shard(tmp_path / "ok.safetensors", header, b"abcd")))
    assert [(t.name, t.shape, t.nbytes) for t in checkpoint.tensors] == [("w\u00e9\n", (4,), 4)]
    assert checkpoint.metadata == {}


def test_a_header_read_in_pieces_reads_the_same(tmp_path: Path) -> None:
    padded = b'{"__metadata__":{"k":"' + b"v" * (3 * FIRST_READ) + b'"},"w":{"dtype":"U8","shape":[4],' \
             + b" " * FIRST_READ + b'"data_offsets":[0,4]}}'
    tensors, metadata = parse_header("p", io.BytesIO(padded).read, len(padded), 1)
    assert [t.name for t in tensors] == ["w"] and len(metadata["k"]) == 3 * FIRST_READ
    with pytest.raises(BadArgument, match="truncated while it was read"):
        parse_header("p", io.BytesIO(padded[:-10]).read, len(padded), 1)


@pytest.mark.parametrize(("index", "needle"), [
    ({"weight_map": {"a": "x.safetensors"}, "extra": 1}, "has the key 'extra'"),
    ({"metadata": {"total": 1}}, "has no 'weight_map'"),
    ({"weight_map": {"a": "x"}, "metadata": {"n": 10 ** 19}}, "expected ',' or '}'"),
    ({"weight_map": {"a": "x"}, "metadata": {"n": {"deeper": 1}}}, "expected a string, a number"),
], ids=["unknown key", "no weight_map", "number msgpack cannot carry", "nested metadata"])
def test_a_hostile_index_is_one_line(tmp_path: Path, index: dict[str, Any], needle: str) -> None:
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    _bad(tmp_path, INDEX_NAME, needle)


def test_an_index_above_its_limit_is_refused_unread(tmp_path: Path) -> None:
    with open(tmp_path / INDEX_NAME, "wb") as sparse:
        sparse.truncate(MAX_INDEX_BYTES + 1)
    _bad(tmp_path, INDEX_NAME, f"larger than {MAX_INDEX_BYTES} bytes")


def test_the_readme_states_the_checkpoint_limits_as_declared() -> None:
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    said = readme[readme.index("The client's\ncheckpoint limits"):].split("\n\n")[0].replace("\n", " ")
    for stated in (f"header of at most {MAX_HEADER_BYTES} bytes", f"index of at most {MAX_INDEX_BYTES} bytes",
                   f"at most {MAX_TENSORS} tensors", f"names of 1 to {MAX_NAME_CHARS} characters",
                   f"at most {MAX_DIMS} dimensions"):
        assert stated in said, f"README.md should say {stated!r}: {said}"


def test_a_file_the_safetensors_package_writes_reads_the_same(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = {"a": np.arange(5, dtype=np.float32), 'b\u00e9"\n': np.zeros((2, 0, 3), dtype=np.int64),
               "c": np.ones((3, 3), dtype=np.float16)}
    path = tmp_path / "written.safetensors"
    save_file(tensors, str(path), metadata={"format": "np", "quoted": 'v"\\'})
    checkpoint = read_checkpoint(str(path))
    raw = path.read_bytes()
    assert checkpoint.metadata == {"format": "np", "quoted": 'v"\\'}
    assert {t.name for t in checkpoint.tensors} == set(tensors) == set(load_file(str(path)))
    for t in checkpoint.tensors:
        assert raw[t.offset:t.offset + t.nbytes] == tensors[t.name].tobytes(), t.name
