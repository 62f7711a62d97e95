"""How sizes and durations read in ``cuctx`` output and the daemon's log."""

from __future__ import annotations

import pytest

from cuctxd.client.cli.tables import human_duration, watch_frame
from cuctxd.protos.sizes import human_size


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (512, "512 B"), (1024, "1 KiB"), (64 << 20, "64 MiB"),
                                         (1 << 30, "1 GiB"), (1536 << 20, "1.5 GiB"), (3 << 40, "3 TiB"),
                                         ((1 << 30) + 1, "1.0 GiB"), (1 << 50, "1024 TiB")])
def test_human_size(n: int, text: str) -> None:
    assert human_size(n) == text


@pytest.mark.parametrize(("seconds", "text"), [(93.859e-3, "93.9 ms"), (250e-6, "250 µs"), (0.0, "0 µs"),
                                               (1.5, "1.50 s"), (1e-3, "1.0 ms")])
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_a_watch_frame_clears_only_on_a_terminal() -> None:
    on_tty = watch_frame("body", "ipc:///x", 2.0, "12:00:00", clear=True)
    piped = watch_frame("body", "ipc:///x", 2.0, "12:00:00", clear=False)
    assert on_tty.startswith("\x1b[H\x1b[2J")
    assert "\x1b" not in piped
    assert piped.startswith("every 2 s: ipc:///x  12:00:00") and piped.endswith("body\n\n")
