"""Hypothesis strategies for the checkpoint fuzz: a small valid checkpoint (shards, maybe an index), then
hostile edits of its headers, its bytes, its files and its index, written to a directory by :func:`build`.

The edits: data offsets out of range or reversed, overlapping ranges, shapes and dtypes that do not match the
bytes, names empty, too long, not UTF-8 or repeated, keys twice, keys safetensors does not know, metadata
that is not strings, thousands (or one past ``MAX_TENSORS``) of empty tensors; headers nested up to 100,000
deep, flipped, cut, padded, with a length field that lies; shards that are FIFOs, directories, symlink
loops, dangling links or a character device; index entries outside the directory (``..``, absolute, through
a symlinked folder), missing, a directory, a FIFO, a loop; an index nested deep. Every input drawn is counted
in ``strategies.INPUTS``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from cuctxd.client.tensors.checkpoints import INDEX_NAME, MAX_HEADER_BYTES, SAFETENSORS_DTYPES
from cuctxd.protos.layouts import DTYPES, MAX_DIMS, MAX_NAME_CHARS, MAX_TENSORS
from tests.checkpoint_files import zero_size_header
from tests.reliability.strategies import INPUTS

_ITEMSIZE = {code: DTYPES[name].itemsize for code, name in SAFETENSORS_DTYPES.items()}
_NOT_FILES = ("fifo", "directory", "loop", "dangling", "device")


@dataclass
class Entry:
    """One header member as it will be written: key and value, any JSON (duplicates allowed)."""

    key: str
    value: Any


@dataclass
class Shard:
    name: str
    entries: list[Entry]
    data: bytes
    raw_edits: list[tuple[str, Any]] = field(default_factory=list)
    replaced_by: str | None = None


@dataclass
class CheckpointPlan:
    """What :func:`build` writes: the shards, the index (``weight_map`` entries by tensor), what to load."""

    shards: list[Shard]
    index: dict[str, str] | None
    index_raw: bytes | None
    extra_files: list[str]
    target: str  # "directory", "index" or "file"


@st.composite
def _shard(draw: st.DrawFn, number: int) -> Shard:
    entries, data = [], b""
    for i in range(draw(st.integers(0, 4))):
        code = draw(st.sampled_from(sorted(_ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = _ITEMSIZE[code] * _prod(shape)
        entries.append(Entry(f"s{number}.t{i}", {"dtype": code, "shape": shape,
                                                  "data_offsets": [len(data), len(data) + nbytes]}))
        data += bytes((number * 31 + i + k) % 256 for k in range(nbytes))
    if draw(st.booleans()):
        entries.insert(0, Entry("__metadata__", {"format": "pt"}))
    return Shard(f"model-{number:05d}.safetensors", entries, data)


def _prod(shape: list[int]) -> int:
    product = 1
    for n in shape:
        product *= n
    return product


_HOSTILE_NAMES = st.sampled_from(["", "x" * (MAX_NAME_CHARS + 1), "\ud800", "a\nb", "__metadata__", "s0.t0",
                                  "\u00e9\u4e2d"])
_HOSTILE_INTS = st.one_of(st.integers(-3, 70), st.sampled_from([2 ** 63, 2 ** 64, 10 ** 30, -(2 ** 63)]),
                          st.floats(allow_nan=False, allow_infinity=False))
_HOSTILE_VALUES = st.one_of(st.none(), st.booleans(), _HOSTILE_INTS, st.text(max_size=4),
                            st.lists(_HOSTILE_INTS, max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                 max_size=2))


@st.composite
def _entry_edit(draw: st.DrawFn, shard: Shard) -> None:
    """One hostile edit of ``shard``'s header members, in place."""
    kind = draw(st.sampled_from(["offsets", "overlap", "shape", "dtype", "duplicate", "extra key", "zeros",
                                 "name", "metadata", "value"]))
    INPUTS[f"checkpoint header: {kind}"] += 1
    tensors = [e for e in shard.entries if isinstance(e.value, dict) and "dtype" in e.value]
    target = draw(st.sampled_from(tensors)) if tensors else None
    if kind == "zeros":
        count = draw(st.sampled_from([10, 3000, MAX_TENSORS + 1]))
        shard.entries.extend(Entry(f"z{n}", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})
                             for n in range(count))
    elif kind == "metadata":
        shard.entries.append(Entry("__metadata__", draw(_HOSTILE_VALUES)))
    elif target is None:
        return
    elif kind == "offsets":
        target.value["data_offsets"] = draw(st.lists(_HOSTILE_INTS, min_size=0, max_size=3))
    elif kind == "overlap":
        target.value["data_offsets"] = list(draw(st.sampled_from(tensors)).value["data_offsets"])
    elif kind == "shape":
        target.value["shape"] = draw(st.one_of(st.lists(_HOSTILE_INTS, max_size=4),
                                               st.just([1] * (MAX_DIMS + 1)), _HOSTILE_VALUES))
    elif kind == "dtype":
        target.value["dtype"] = draw(st.one_of(st.sampled_from([*_ITEMSIZE, "F6_E2M3", "f32", ""]), _HOSTILE_VALUES))
    elif kind == "duplicate":
        shard.entries.append(Entry(target.key, dict(target.value)))
    elif kind == "extra key":
        target.value[draw(st.sampled_from(["extra", "dtype ", "__metadata__"]))] = draw(_HOSTILE_VALUES)
    elif kind == "name":
        target.key = draw(_HOSTILE_NAMES)
    else:
        target.value = draw(_HOSTILE_VALUES)


_NESTINGS = st.tuples(st.sampled_from([b"[", b'{"a":']), st.sampled_from([3, 1000, 100_000]))
_RAW_EDITS = st.one_of(
    st.tuples(st.just("nest"), _NESTINGS),
    st.tuples(st.just("flip"), st.tuples(st.floats(0, 1), st.binary(min_size=1, max_size=1))),
    st.tuples(st.just("cut header"), st.floats(0, 1)),
    st.tuples(st.just("insert"), st.tuples(st.floats(0, 1), st.sampled_from([b"\xff", b"\xc3", b"\xc0\x80", b" " * 4096,
                                                                            b"\\ud800", b'"', b"\x00"]))),
    st.tuples(st.just("length"), st.sampled_from([0, 1, 7, MAX_HEADER_BYTES + 1, 2 ** 64 - 1, -1])),
    st.tuples(st.just("cut data"), st.integers(1, 64)),
    st.tuples(st.just("pad"), st.sampled_from([b" " * 3, b"\n\t ", b" x"])),
)
_INDEX_ENTRIES = st.sampled_from(["../outside.safetensors", "/abs", "missing.safetensors", "sub", "fifo.safetensors",
                                  "loop.safetensors", "up/outside.safetensors", "sub/../model-00000.safetensors",
                                  "./model-00000.safetensors", "", "a\x00b"])
_INDEX_RAW = st.sampled_from([b'{"metadata":{"k":' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
                              b'{"weight_map":{"a":"x","a":"y"}}', b'{"weight_map":{}}', b"[]", b"\xff",
                              b'{"weight_map":{"s0.t0":"model-00000.safetensors"},"metadata":{"total_size":1e999}}'])


@st.composite
def checkpoint_plans(draw: st.DrawFn) -> CheckpointPlan:
    """A checkpoint of 1 to 3 shards, then 0 to 3 hostile edits of its headers, bytes, files and index."""
    shards = [draw(_shard(number)) for number in range(draw(st.integers(1, 3)))]
    target = draw(st.sampled_from(["directory", "index", "file"]))
    with_index = target == "index" or (target == "directory" and draw(st.booleans()))
    index = {e.key: s.name for s in shards for e in s.entries if e.key != "__metadata__"} if with_index else None
    plan = CheckpointPlan(shards, index, None, [], target)
    for _ in range(draw(st.integers(0, 3))):
        shard = draw(st.sampled_from(shards))
        kind = draw(st.sampled_from(["entries", "raw", "file", "extra file", "index"]))
        if kind == "entries":
            draw(_entry_edit(shard))
        elif kind == "raw":
            shard.raw_edits.append(draw(_RAW_EDITS))
            INPUTS[f"checkpoint bytes: {shard.raw_edits[-1][0]}"] += 1
        elif kind == "file":
            shard.replaced_by = draw(st.sampled_from(_NOT_FILES))
            INPUTS[f"checkpoint shard: {shard.replaced_by}"] += 1
        elif kind == "extra file":
            plan.extra_files.append(draw(st.sampled_from(_NOT_FILES)))
            INPUTS[f"checkpoint extra file: {plan.extra_files[-1]}"] += 1
        elif plan.index is not None:
            if draw(st.booleans()) and plan.index:
                plan.index[draw(st.sampled_from(sorted(plan.index)))] = draw(_INDEX_ENTRIES)
                INPUTS["checkpoint index: entry"] += 1
            else:
                plan.index_raw = draw(_INDEX_RAW)
                INPUTS["checkpoint index: raw"] += 1
    return plan


def _header(shard: Shard) -> bytes:
    members = (json.dumps(e.key).encode() + b":" + json.dumps(e.value).encode() for e in shard.entries)
    return b"{" + b",".join(members) + b"}"


def _zeros_fast(shard: Shard) -> bytes | None:
    """The header of a shard that is only (many) empty tensors, made quickly; None for any other."""
    if len(shard.entries) > 1000 and all(e.key.startswith("z") for e in shard.entries[-1000:]):
        head = _header(Shard(shard.name, [e for e in shard.entries if not e.key.startswith("z")], b""))
        zeros = zero_size_header(sum(1 for e in shard.entries if e.key.startswith("z"))).replace(b'"t', b'"z')
        return head[:-1] + (b"," if len(head) > 2 else b"") + zeros[1:]
    return None


def _apply(header: bytes, data: bytes, edit: tuple[str, Any]) -> tuple[bytes, bytes, int | None]:
    kind, arg = edit
    length = None
    if kind == "nest":
        opener, depth = arg
        header = opener * depth + (b"]" if opener == b"[" else b"1}") * depth
    elif kind == "flip" and header:
        at = min(int(arg[0] * len(header)), len(header) - 1)
        header = header[:at] + arg[1] + header[at + 1:]
    elif kind == "cut header":
        header = header[:int(arg * len(header))]
    elif kind == "insert":
        at = int(arg[0] * len(header))
        header = header[:at] + arg[1] + header[at:]
    elif kind == "length":
        length = arg % 2 ** 64
    elif kind == "cut data":
        data = data[:-arg]
    elif kind == "pad":
        header += arg
    return header, data, length


def _not_a_file(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "dangling":
        path.symlink_to("nowhere")
    else:
        path.symlink_to("/dev/null")


def build(base: Path, plan: CheckpointPlan) -> tuple[Path, Path]:
    """Write ``plan`` into ``base/ckpt`` (``base`` also holds a file outside it); the checkpoint's directory
    and the path to load."""
    root = base / "ckpt"
    root.mkdir()
    _outside = base / "outside.safetensors"
    _outside.write_bytes(struct.pack("<Q", 2) + b"{}")
    for shard in plan.shards:
        path = root / shard.name
        if shard.replaced_by is not None:
            _not_a_file(path, shard.replaced_by)
            continue
        header, data, length = _zeros_fast(shard) or _header(shard), shard.data, None
        for edit in shard.raw_edits:
            header, data, said = _apply(header, data, edit)
            length = said if said is not None else length
        path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    for number, kind in enumerate(plan.extra_files):
        extra = root / f"zz{number}.safetensors"
        if not os.path.lexists(extra):
            _not_a_file(extra, kind)
    if plan.index is not None or plan.index_raw is not None:
        (root / "sub").mkdir()
        os.mkfifo(root / "fifo.safetensors")
        (root / "loop.safetensors").symlink_to("loop.safetensors")
        (root / "up").symlink_to("..")
        raw = plan.index_raw or json.dumps({"metadata": {"total_size": 1}, "weight_map": plan.index}).encode()
        (root / INDEX_NAME).write_bytes(raw)
    if plan.target == "file":
        return root, root / plan.shards[0].name
    if plan.target == "index":
        return root, root / INDEX_NAME
    return root, root


__all__ = ["CheckpointPlan", "build", "checkpoint_plans"]
