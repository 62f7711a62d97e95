"""Fuzz the checkpoint reader and ``cuctx load``'s client with hostile checkpoints (checkpoint_strategies.py).

For every checkpoint drawn, ``read_checkpoint`` either returns one whose every tensor lies inside its shard,
is the size its dtype and shape say and overlaps no other, with a name of 1 to ``MAX_NAME_CHARS``
characters, at most ``MAX_DIMS`` dimensions and at most ``MAX_TENSORS`` tensors in all, whose shards are
regular files in folders inside the checkpoint's directory and whose manifest a layout holds; or it raises
``BadArgument`` in one line that starts with a path in the checkpoint's directory. Never another exception,
never a hang (the module's timeout). A smaller draw goes through ``load_safetensors`` with a real client
against a real sim daemon: a load publishes exactly the files' bytes, a refusal leaves nothing published or
allocated. CI draws a few hundred checkpoints, derandomized; ``CUCTXD_SOAK=1`` draws 50x as many at random.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given

from cuctxd.client import Client
from cuctxd.client.tensors.checkpoints import Checkpoint, read_checkpoint
from cuctxd.client.tensors.publishing import layout_offsets
from cuctxd.client.tensors.safetensors_load import checkpoint_digest, load_safetensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import (
    DTYPES,
    MAX_DIMS,
    MAX_NAME_CHARS,
    MAX_TENSORS,
    Manifest,
    TensorSpec,
    c_strides,
    check_manifest,
)
from tests.helpers import DaemonProcess
from tests.integration.test_checkpoints import nothing_left
from tests.reliability.checkpoint_strategies import CheckpointPlan, build, checkpoint_plans
from tests.reliability.strategies import INPUTS, fuzz_settings, soak_mode

pytestmark = pytest.mark.timeout(0 if soak_mode() else 600)


@contextlib.contextmanager
def _built(plan: CheckpointPlan) -> Iterator[tuple[Path, Path]]:
    """The plan written into a fresh directory (hypothesis runs many examples in one test): its checkpoint
    directory and the path to load; removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="cuctxd-ckpt-fuzz-"))
    try:
        yield build(base, plan)
    finally:
        shutil.rmtree(base)


def _one_line_naming(error: BadArgument, root: Path) -> None:
    assert "\n" not in str(error), str(error)
    assert error.message.startswith(str(root)), error.message


def _consistent(checkpoint: Checkpoint, root: Path) -> None:
    """What a checkpoint the reader returns must be (module docstring)."""
    names = [t.name for t in checkpoint.tensors]
    assert len(names) <= MAX_TENSORS and len(set(names)) == len(names)
    inside = os.path.realpath(root)
    for shard in checkpoint.shards:
        assert stat.S_ISREG(os.stat(shard.path).st_mode), shard.path
        assert os.path.commonpath([inside, os.path.realpath(os.path.dirname(shard.path))]) == inside, shard.path
    end_of: dict[int, int] = {}
    for t in sorted(checkpoint.tensors, key=lambda t: (t.shard, t.offset)):
        assert 1 <= len(t.name) <= MAX_NAME_CHARS and len(t.shape) <= MAX_DIMS, t
        assert t.nbytes == math.prod(t.shape) * DTYPES[t.dtype].itemsize, t
        assert t.offset + t.nbytes <= checkpoint.shards[t.shard].size, t
        if t.nbytes:
            assert t.offset >= end_of.get(t.shard, 0), f"{t.name} overlaps the tensor before it"
            end_of[t.shard] = t.offset + t.nbytes
    offsets, size = layout_offsets(t.nbytes for t in checkpoint.tensors)
    check_manifest(Manifest(tuple(TensorSpec(t.name, t.dtype, t.shape, c_strides(t.shape), offset)
                                  for t, offset in zip(checkpoint.tensors, offsets, strict=True)),
                            checkpoint.metadata).pack(), size)


@fuzz_settings(300)
@given(plan=checkpoint_plans())
def test_the_reader_refuses_by_name_or_reads_a_consistent_checkpoint(plan: CheckpointPlan) -> None:
    with _built(plan) as (root, target):
        try:
            checkpoint = read_checkpoint(str(target))
        except BadArgument as error:
            INPUTS["checkpoint refused"] += 1
            _one_line_naming(error, root)
            return
        INPUTS["checkpoint read"] += 1
        _consistent(checkpoint, root)


@pytest.fixture(scope="module")
def observer(daemon: DaemonProcess) -> Iterator[Client]:
    """A session that loads nothing: it checks what each example's loading session left."""
    with Client(daemon.endpoint, timeout=30) as client:
        yield client


@fuzz_settings(40)
@given(plan=checkpoint_plans())
def test_a_load_publishes_the_files_bytes_or_leaves_nothing(daemon: DaemonProcess, observer: Client,
                                                            plan: CheckpointPlan) -> None:
    with _built(plan) as (root, target), Client(daemon.endpoint, timeout=30) as loader:
        try:
            loaded = load_safetensors(loader, str(target), "fuzzed")
        except BadArgument as error:
            INPUTS["checkpoint load refused"] += 1
            _one_line_naming(error, root)
            nothing_left(observer)
            return
        INPUTS["checkpoint loaded"] += 1
        try:
            checkpoint = read_checkpoint(str(target))
            assert loaded.digest == checkpoint_digest(checkpoint)
            with open_tensors(observer, "fuzzed", digest=loaded.digest) as opened:
                for t in checkpoint.tensors:
                    if DTYPES[t.dtype].typestr is None:
                        continue  # bfloat16: numpy has no view of it; the digest above vouches for its bytes
                    with open(checkpoint.shards[t.shard].path, "rb") as file:
                        file.seek(t.offset)
                        assert np.asarray(opened[t.name]).tobytes() == file.read(t.nbytes), t.name
        finally:
            loader.unpublish("fuzzed")
    nothing_left(observer)  # the loading session closed: its buffer went with it
