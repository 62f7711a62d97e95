"""Figure 9's checkpoint loads: the generated file, the page cache helpers, and the figure on a real sim daemon."""

from __future__ import annotations

import inspect
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.checkpoints import FULL_MODEL, QUICK_MODEL, evict, read_through, resident_fraction, write_checkpoint
from bench.figures import checkpoint_load
from bench.run import Bench
from bench.settings import QUICK
from cuctxd.client.tensors.safetensors_load import load_safetensors


@pytest.fixture(scope="module")
def bench() -> Iterator[Bench]:
    with Bench(QUICK, "sim", 1) as running:
        yield running


def test_the_checkpoint_is_a_real_shaped_bf16_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    size = write_checkpoint(str(path), QUICK_MODEL)
    assert size == path.stat().st_size
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    assert (8 + length) % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    assert 250 <= len(header) <= 300 and {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert size == 8 + length + QUICK_MODEL.nbytes
    largest = max(header, key=lambda name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0])
    assert largest in ("model.embed_tokens.weight", "lm_head.weight")
    assert len(header["model.layers.0.input_layernorm.weight"]["shape"]) == 1
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), framework="numpy") as opened:  # the format's own reader accepts it
        assert len(list(opened.keys())) == len(header)
    assert FULL_MODEL.nbytes >= 2e9 and len(FULL_MODEL.tensors()) == len(header)


def _filesystem(path: Path) -> str:
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    return max((m for m in mounts if str(path).startswith(m[1])), key=lambda m: len(m[1]))[2]


def test_the_page_cache_helpers_make_and_see_warm_and_cold(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_checkpoint(str(path), QUICK_MODEL)
    read_through(str(path))
    assert resident_fraction(str(path)) == 1.0
    if _filesystem(tmp_path) == "tmpfs":
        pytest.skip("a tmpfs keeps every page: nothing to evict")
    evict(str(path))
    assert resident_fraction(str(path)) < checkpoint_load.COLD_RESIDENT


def test_an_anchor_that_cannot_run_is_dropped_with_its_reason(bench: Bench, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_checkpoint(str(path), QUICK_MODEL)
    loads = checkpoint_load._measure(bench, str(path), [checkpoint_load.OURS, "safetensors"], 2, lambda: None)
    assert len(loads.seconds[checkpoint_load.OURS]) == 2 and "safetensors" not in loads.seconds
    assert loads.unavailable["safetensors"].startswith("safetensors failed: exited 1:")


def test_figure_9_loads_the_checkpoint_and_reports_measured_numbers_on_the_sim(bench: Bench) -> None:
    figures = {figure.name.split(" checkpoint (255 tensors)")[1]: figure for figure in checkpoint_load.run(bench)}
    assert not [f for f in figures.values() if f.error]
    warm = figures[", warm, vs safetensors"]
    assert warm.skipped and warm.target == ">= 3"
    rate = re.search(r"needs the cuda backend; the daemon runs sim \(cuctx load: ([\d.]+) GB/s warm on sim\)",
                     warm.reason or "")
    assert rate and float(rate[1]) > 0, warm.reason
    digest = figures[" with content digests, warm: seconds with / without"]
    assert digest.target == "<= 1.10"
    if "digest" in inspect.signature(load_safetensors).parameters:
        assert digest.value and digest.anchor_value and digest.ratio == digest.value / digest.anchor_value
    else:
        assert digest.skipped and "no digest= keyword" in (digest.reason or "")
    cold = figures[", cold, vs the same load warm"]
    if cold.skipped:
        assert "eviction did not take" in (cold.reason or "")
    else:
        assert cold.value and cold.anchor_value and cold.ratio == cold.value / cold.anchor_value
        assert "of the file was in the page cache" in (cold.note or "")
        best = figures[", cold, vs the fastest other loader"]
        assert best.skipped and best.target == ">= 1.2" and "no other loader ran" in (best.reason or "")
        assert set(figures) >= {f", {state}, vs {anchor}" for state in ("warm", "cold")
                                for anchor in checkpoint_load.ANCHORS}
