"""Percentiles and timing helpers; every sample is a ``time.perf_counter_ns`` difference."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50.0)


def time_calls(call: Callable[[], object], count: int, warmup: int = 0) -> list[int]:
    """Run ``call`` ``warmup`` times untimed, then ``count`` times; nanoseconds per call."""
    for _ in range(warmup):
        call()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(count):
        start = clock()
        call()
        samples.append(clock() - start)
    return samples


def interleaved(calls: Mapping[str, Callable[[], object]], count: int, warmup: int,
                blocks: int = 10) -> dict[str, list[int]]:
    """Time several calls in alternating blocks, so drift in the machine's state hits each alike."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[int]] = {name: [] for name in calls}
    per_block = max(1, count // blocks)
    for _ in range(blocks):
        for name, call in calls.items():
            samples[name].extend(time_calls(call, per_block))
    return samples


def us(ns: float) -> float:
    return ns / 1e3


def gbps(size: int, ns: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) of ``size`` bytes in ``ns`` nanoseconds."""
    return size / ns  # bytes per ns == GB/s
