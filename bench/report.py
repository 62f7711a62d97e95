"""The printed table and the JSON file of one run."""

from __future__ import annotations

import json
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


def table(figures: Sequence[Figure], meta: dict[str, Any]) -> str:
    header = ("#", "figure", "value", "unit", "anchor", "anchor value", "ratio", "target", "result")
    rows = [header]
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
    numeric = {2, 5, 6}
    lines = [f"cuctxd bench: backend {meta.get('backend')}, {meta.get('devices')} device(s), "
             f"{'quick' if meta.get('quick') else 'full'} run, {meta.get('duration_s', 0):.0f} s "
             f"on {meta.get('host')} ({meta.get('cpus')} CPUs)"]
    for n, row in enumerate(rows):
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    passed = sum(1 for f in figures if f.passed is True)
    judged = sum(1 for f in figures if f.passed is not None)
    lines.append(f"targets met: {passed} of {judged}; skipped: {sum(f.skipped for f in figures)}; "
                 f"errors: {sum(f.error for f in figures)}")
    lines.extend(footnotes)
    return "\n".join(lines)


def write_json(path: Path, figures: Sequence[Figure], meta: dict[str, Any]) -> None:
    document = {"meta": meta, "figures": [figure.to_json() for figure in figures]}
    path.write_text(json.dumps(document, indent=2) + "\n")
