"""One measured figure as the report and the JSON carry it: :class:`Figure`.

``ratio`` is always ``value / anchor_value``; ``target`` is a condition on the
ratio ("<= 1.15", ">= 0.85", "< 2.0"). A figure the backend cannot run is
``skipped`` with a ``reason``; a figure whose measurement broke is an ``error``
(``passed`` false). Nothing here is ever filled in without a measurement.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
}


def check_target(ratio: float, target: str) -> bool:
    """Whether ``ratio`` meets ``target`` ("<= 1.15" style); ValueError for a malformed target."""
    op, _, threshold = target.partition(" ")
    if op not in _OPS:
        raise ValueError(f"target {target!r} must start with one of {', '.join(_OPS)}")
    return _OPS[op](ratio, float(threshold))


@dataclass
class Figure:
    figure: int
    name: str
    value: float | None
    unit: str
    anchor_name: str
    anchor_value: float | None
    ratio: float | None
    target: str | None = None
    passed: bool | None = None
    skipped: bool = False
    error: bool = False
    reason: str | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        return {k: v for k, v in record.items() if v is not None or k in _ALWAYS}


_ALWAYS = {"name", "value", "unit", "anchor_name", "anchor_value", "ratio", "passed"}


def measured(figure: int, name: str, value: float, unit: str, anchor_name: str, anchor_value: float | None,
             *, target: str | None = None, note: str | None = None) -> Figure:
    """A figure with its anchor measured in this run; ``passed`` is judged here and nowhere else."""
    ratio = value / anchor_value if anchor_value else None
    passed = check_target(ratio, target) if target is not None and ratio is not None else None
    return Figure(figure, name, value, unit, anchor_name, anchor_value, ratio, target, passed, note=note)


def skipped(figure: int, name: str, unit: str, anchor_name: str, reason: str, *,
            target: str | None = None) -> Figure:
    return Figure(figure, name, None, unit, anchor_name, None, None, target, None, skipped=True, reason=reason)


def failed(figure: int, name: str, reason: str) -> Figure:
    """A measurement that raised: reported, counted as not passed, never hidden."""
    return Figure(figure, name, None, "", "", None, None, None, False, error=True, reason=reason)
