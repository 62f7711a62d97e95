"""Figure 10 on a real sim daemon (--quick): a trainer process and 4 engine processes, zero-copy and copy mode
timed, their stages reported and their memory measured; the CUDA IPC anchors skipped with the reason."""

from __future__ import annotations

from bench.figures import weight_sync
from bench.run import Bench
from bench.settings import QUICK


def test_figure_10_times_both_modes_and_skips_the_cuda_anchors_on_the_sim() -> None:
    with Bench(QUICK, "sim", 1) as bench:
        figures = list(weight_sync.run(bench))
        with bench.client() as client:
            assert client.list_shared() == [], "the versions are unpublished after the figure"
            free, total = client.mem_get_info()
            assert free == total, "every version is freed once its engines are gone"
    assert {figure.figure for figure in figures} == {10}
    assert not any(figure.error for figure in figures), figures
    timed = [f for f in figures if f.unit == "s" and ", stage: " not in f.name]
    assert not any(f.skipped for f in timed) and all(f.value is not None and f.value > 0 for f in timed)
    assert all(f.anchor_value is None and "cuda backend" in (f.note or "") for f in timed[:3])  # anchors not run
    assert timed[3].value is not None and timed[3].value > 0 and timed[3].anchor_value is not None
    memory = {f.name.split(": ")[-1].split(",")[0]: f for f in figures if f.unit == "GiB"}
    assert set(memory) == {"zero-copy", "copy", "per-tensor", "buckets"}
    zero_copy = memory["zero-copy"]
    # on the sim only the daemon's memory counts: two versions at the peak (the engines' old one and the new one)
    assert zero_copy.ratio is not None and 1.9 <= zero_copy.ratio <= 2.1 and zero_copy.passed
    # copy: the current version and the spare, the older version's allocation kept for the next one (the daemon
    # held two versions during each publish before as well)
    assert memory["copy"].ratio is not None and 1.9 <= memory["copy"].ratio <= 2.1
    assert memory["buckets"].skipped and "64 MiB" in zero_copy.name
    stages = {f.name.split(": ", 1)[1].split(", median")[0]: f for f in figures if ", stage: " in f.name}
    for way, engine_stage in (("zero-copy", "engine refresh"), ("copy", "engine copy_into")):
        total = stages[f"{way}, stage: trainer total"]
        assert total.value is not None and total.anchor_value is not None and 0 < total.value < total.anchor_value
        assert (stages[f"{way}, stage: {engine_stage}"].value or 0) > 0
        woken = stages[f"{way}, stage: last engine woken, from the call"].value
        assert woken is not None and 0 < woken < total.anchor_value
