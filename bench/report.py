"""The printed table and the JSON file of one run."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.records import Figure


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def verdict(figure: Figure) -> str:
    if figure.error:
        return "ERROR"
    if figure.skipped:
        return "skipped"
    if figure.passed is None:
        return "-"
    return "PASS" if figure.passed else "FAIL"


#: Widest the wrapped columns (figure, anchor) print; the JSON keeps their full text.
WRAP = {1: 34, 4: 30}


def table(figures: Sequence[Figure], meta: dict[str, Any]) -> str:
    """The run as a table for a terminal: long figure and anchor names wrap onto more lines."""
    header = ("#", "figure", "value", "unit", "anchor", "anchor value", "ratio", "target", "result")
    rows: list[tuple[str, ...]] = [header]
    footnotes: list[str] = []
    for figure in figures:
        result = verdict(figure)
        text = figure.reason if (figure.skipped or figure.error) else None
        if text:
            footnotes.append(f"[{len(footnotes) + 1}] {figure.name}: {text}")
            result = f"{result} [{len(footnotes)}]"
        rows.append((str(figure.figure), figure.name, number(figure.value), figure.unit, figure.anchor_name,
                     number(figure.anchor_value), "-" if figure.ratio is None else f"{figure.ratio:.2f}",
                     figure.target or "-", result))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for column, most in WRAP.items():
        widths[column] = min(widths[column], max(most, len(header[column])))
    numeric = {2, 5, 6}
    lines = [f"cuctxd bench: backend {meta.get('backend')}, {meta.get('devices')} device(s), "
             f"{'quick' if meta.get('quick') else 'full'} run, {meta.get('duration_s', 0):.0f} s "
             f"on {meta.get('host')} ({meta.get('cpus')} CPUs)"]
    for n, row in enumerate(rows):
        lines.extend(_row_lines(row, widths, numeric))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    passed = sum(1 for f in figures if f.passed is True)
    judged = sum(1 for f in figures if f.passed is not None)
    lines.append(f"targets met: {passed} of {judged}; skipped: {sum(f.skipped for f in figures)}; "
                 f"errors: {sum(f.error for f in figures)}")
    lines.extend(footnotes)
    return "\n".join(lines)


def _row_lines(row: Sequence[str], widths: Sequence[int], numeric: set[int]) -> list[str]:
    """One table row as lines: a cell wider than its column wraps onto the next lines, in that column."""
    wrapped = [textwrap.wrap(cell, width) or [""] if i in WRAP else [cell]
               for i, (cell, width) in enumerate(zip(row, widths, strict=True))]
    lines = []
    for k in range(max(len(cell) for cell in wrapped)):
        parts = [cell[k] if k < len(cell) else "" for cell in wrapped]
        cells = [p.rjust(widths[i]) if i in numeric else p.ljust(widths[i]) for i, p in enumerate(parts)]
        lines.append("  ".join(cells).rstrip())
    return lines


def write_json(path: Path, figures: Sequence[Figure], meta: dict[str, Any]) -> None:
    document = {"meta": meta, "figures": [figure.to_json() for figure in figures]}
    path.write_text(json.dumps(document, indent=2) + "\n")
