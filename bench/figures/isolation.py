"""Figure 6: head-of-line isolation, two ways.

6a. Small ops on device B while another client keeps device A busy with a
chain of large device-to-device copies, against the same ops with A idle. It
needs two devices: with one (the cuda machine here) it is skipped; sim runs it
with ``--sim-devices 2``.

6b. A small worker op on device A (``current_context``: it touches no stream,
so it has no GPU work to wait for) while another client's ``synchronize`` on A
waits for a burst of large copies. Only samples that started while that
``synchronize`` was in flight count. If ``synchronize`` is not long (it waits,
beyond an empty ``synchronize``, less than ten idle round trips of the probe:
the copies ran while they were issued, as on the sim), there is nothing to
overlap and it is skipped, saying so.

Target for both: the delay over idle is below one round trip of the same op
when idle, i.e. the p50 ratio is < 2.0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from bench.loads import Load, copy_chain, sync_chain
from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.stats import median, percentile, time_calls, us

FIGURE = 6
TITLE = "head-of-line isolation"
DEVICE_A, DEVICE_B = 0, 1
TARGET = "< 2.0"
_MIN_SAMPLES = 20
#: A synchronize counts as long when it waits (beyond an empty synchronize) this many idle probe round trips.
_LONG_SYNC_ROUND_TRIPS = 10
_POLL_S = 50e-6


def _copy_size(bench: Bench) -> int:
    return bench.settings.cuda_copy_size if bench.backend == "cuda" else bench.settings.sim_copy_size


def run(bench: Bench) -> Iterator[Figure]:
    yield from _other_device(bench)
    yield from _during_synchronize(bench)


def _pair(name: str, busy: list[int], idle: list[int], anchor: str, note: str) -> Iterator[Figure]:
    yield measured(FIGURE, f"{name} p50", us(median(busy)), "us", f"{anchor} p50", us(median(idle)),
                   target=TARGET, note=note)
    yield measured(FIGURE, f"{name} p99", us(percentile(busy, 99)), "us", f"{anchor} p99",
                   us(percentile(idle, 99)), note=note)


def _other_device(bench: Bench) -> Iterator[Figure]:
    name = "64 B read on device B while device A copies"
    anchor = "the same read, device A idle,"
    if bench.device_count < 2:
        for q in ("p50", "p99"):
            yield skipped(FIGURE, f"{name} {q}", "us", f"{anchor} {q}",
                          f"needs 2 devices; the {bench.backend} daemon has {bench.device_count}",
                          target=TARGET if q == "p50" else None)
        return
    s = bench.settings
    size = _copy_size(bench)
    with bench.client() as probe:
        small = probe.alloc(64, device=DEVICE_B)
        out = bytearray(64)

        def op() -> None:
            small.read_into(out)

        idle = time_calls(op, s.isolation_samples, warmup=s.warmup)
        with Load(copy_chain, bench.endpoint(), DEVICE_A, size) as load:
            busy = _sample_for(op, s.isolation_samples, s.isolation_seconds)
    stats = load.stats
    copy_ms = stats.get("copy_ms_p50")
    note = (f"{len(busy)} samples; the load: {stats.get('copies')} copies of {size >> 20} MiB on device A, "
            f"each copy call {copy_ms:.1f} ms (p50), from another client process" if copy_ms is not None else None)
    yield from _pair(name, busy, idle, anchor, note or "")


def _during_synchronize(bench: Bench) -> Iterator[Figure]:
    name = "worker op on device A during another client's synchronize on A"
    anchor = "the same op, device A idle,"
    s = bench.settings
    size = _copy_size(bench)
    with bench.client() as probe:
        def op() -> None:
            probe.current_context(DEVICE_A)

        idle = time_calls(op, s.isolation_samples, warmup=s.warmup)
        during: list[int] = []
        with Load(sync_chain, bench.endpoint(), DEVICE_A, size, s.copies_per_sync, with_phase=True) as load:
            phase = load.phase
            assert phase is not None
            clock = time.perf_counter_ns
            deadline = clock() + int(s.isolation_seconds * 1e9)
            while len(during) < s.isolation_samples and clock() < deadline:
                if phase.value % 2 == 0:
                    time.sleep(_POLL_S)  # wait for the next synchronize without loading the daemon
                    continue
                start = clock()
                op()
                during.append(clock() - start)
    stats = load.stats
    sync_ms, issue_ms, empty_ms = stats.get("sync_ms_p50"), stats.get("issue_ms_p50"), stats.get("empty_sync_ms_p50")
    if sync_ms is None or issue_ms is None or empty_ms is None:
        raise RuntimeError(f"the synchronize load reported no timings: {stats}")
    shape = (f"the load: {s.copies_per_sync} copies of {size >> 20} MiB issued in {issue_ms:.1f} ms (p50), "
             f"then synchronize took {sync_ms:.2f} ms (p50; {empty_ms:.2f} ms with nothing queued), "
             f"{stats.get('syncs')} times")
    wait_ms = sync_ms - empty_ms
    long_enough = _LONG_SYNC_ROUND_TRIPS * median(idle) / 1e6
    if wait_ms < long_enough or len(during) < _MIN_SAMPLES:
        for q in ("p50", "p99"):
            yield skipped(FIGURE, f"{name} {q}", "us", f"{anchor} {q}",
                          f"no long synchronize to overlap: {shape}; it waited {wait_ms:.2f} ms for the copies, "
                          f"under {_LONG_SYNC_ROUND_TRIPS} idle round trips of the probe ({long_enough:.2f} ms): "
                          f"the copies ran while they were issued rather than queued "
                          f"({len(during)} samples started during one)",
                          target=TARGET if q == "p50" else None)
        return
    yield from _pair(name, during, idle, anchor, f"{len(during)} samples started during a synchronize; {shape}")


def _sample_for(op: Callable[[], object], count: int, seconds: float) -> list[int]:
    """Up to ``count`` timed calls, stopping after ``seconds`` (a blocked device can make each slow)."""
    clock = time.perf_counter_ns
    deadline = clock() + int(seconds * 1e9)
    samples: list[int] = []
    while len(samples) < count and clock() < deadline:
        start = clock()
        op()
        samples.append(clock() - start)
    return samples
