"""How a byte count is shown to a person, the same on both sides: ``cuctx`` tables and the daemon's log."""

from __future__ import annotations

_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_size(n: int) -> str:
    """``1073741824`` -> ``"1 GiB"``, ``1610612736`` -> ``"1.5 GiB"``, ``512`` -> ``"512 B"``.

    A whole number of the unit prints without decimals, so an exact size reads
    exactly; anything else gets one decimal.
    """
    for unit, factor in _BINARY_UNITS:
        if abs(n) >= factor:
            return f"{n // factor} {unit}" if n % factor == 0 else f"{n / factor:.1f} {unit}"
    return f"{n} B"
