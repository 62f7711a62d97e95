"""``python -m bench``'s table and exit status, on figures made up here (no timing involved)."""

from __future__ import annotations

import itertools

from bench.__main__ import build_parser, exit_status
from bench.records import failed, measured, skipped
from bench.report import table

LONG_ANCHOR = "bare ZeroMQ receive of the same bytes from a source process over ipc, with msgpack headers"
META = {"backend": "sim", "devices": 2, "quick": True, "duration_s": 1, "host": "h", "cpus": 2}


def _figures() -> list:
    return [
        measured(4, "read 64 MiB (ipc), vs bare ZeroMQ receive of the same bytes, pipelined", 2.62, "GB/s",
                 LONG_ANCHOR, 1.09, target=">= 0.5"),
        measured(1, "ping p50 (ipc)", 109.0, "us", "bare echo, p50", 90.3, target="<= 1.15"),
        skipped(6, "64 B read on device B while device A copies p50", "us", "the same read, idle", "one device"),
    ]


def test_rows_wrap_long_names_and_the_json_keeps_them() -> None:
    figures = _figures()
    text = table(figures, META)
    header, _, *rows = text.split("\ntargets met:")[0].splitlines()[1:]
    assert max(len(row) for row in [header, *rows]) <= 130, text
    start, end = header.index("anchor "), header.index("anchor value")
    first_row = [rows[0], *itertools.takewhile(lambda row: not row[:1].strip(), rows[1:])]  # with continuations
    assert " ".join(row[start:end].strip() for row in first_row).strip() == LONG_ANCHOR
    assert figures[0].to_json()["anchor_name"] == LONG_ANCHOR


def test_check_exits_1_on_a_missed_target() -> None:
    figures = _figures()
    assert [f.passed for f in figures] == [True, False, None]
    assert exit_status(figures, check=False) == 0
    assert exit_status(figures, check=True) == 1
    assert exit_status(figures[:1] + figures[2:], check=True) == 0
    assert exit_status([failed(3, "alloc", "boom")], check=False) == 1
    assert build_parser().parse_args(["--check"]).check is True
    assert build_parser().parse_args([]).check is False
