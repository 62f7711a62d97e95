"""Figure 11 on a real sim daemon: the first reliance of another uid on a layout's digest is hashed by the
daemon, timed against the client's own hash of the same bytes, both measured in the run."""

from __future__ import annotations

from bench.figures import digest_checks
from bench.run import Bench
from bench.settings import QUICK


def test_figure_11_times_a_check_against_the_host_hash_on_the_sim() -> None:
    with Bench(QUICK, "sim", 1) as bench:
        figures = list(digest_checks.run(bench))
        with bench.client() as client:
            assert client.list_shared() == [], "the layouts are unpublished after the figure"
            assert client.status()["devices"][0]["digest_checks"]["checked"] == 1
    assert [figure.unit for figure in figures] == ["s", "GB/s"]
    for figure in figures:
        assert not figure.error and not figure.skipped, figure
        assert figure.value is not None and figure.value > 0 and figure.anchor_value is not None
        assert figure.anchor_value > 0 and "32 MiB" in figure.name
