"""Figure 3: 1 MiB alloc+free through the daemon, against the driver called in this process.

The daemon's ``alloc`` serves pool memory by default (stream-ordered
``cuMemAllocFromPoolAsync``); the anchor is ``cuMemAlloc``+``cuMemFree`` in the
bench process. A ``shareable=True`` pair (a VMM allocation of its own, ``cuMemCreate``
and its mapping, where the device has VMM) is also judged against the default pair
of the same run: at most twice its cost. One by one, a pair costs two round trips, more than the anchor
whatever the daemon does; pipelined (:data:`BATCH` allocs sent without waiting,
then their frees), the cost per pair is what the daemon adds. The floor line
measures that first point: two round trips to the bare echo, against the same
anchor; no daemon can go below it one by one. On sim the
anchor is the sim driver in process, and the target (which is about the GPU)
is not judged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.anchors import RawClient
from bench.cuda_local import LocalCuda, LocalDriverUnavailable, LocalSim
from bench.records import Figure, measured, skipped
from bench.run import Bench, alloc_supports_shareable
from bench.stats import interleaved, median, time_calls, us
from cuctxd.client import Buffer
from cuctxd.client.wire import build as wire

FIGURE = 3
TITLE = "alloc+free 1 MiB"
SIZE = 1 << 20
#: Pairs per pipelined sample.
BATCH = 50


def run(bench: Bench) -> Iterator[Figure]:
    s = bench.settings
    target: str | None = "< 1.0"
    local: LocalCuda | LocalSim
    if bench.backend == "cuda":
        try:
            local = bench.local_cuda()
        except LocalDriverUnavailable as unavailable:
            yield skipped(FIGURE, "alloc+free 1 MiB", "us", "in-process cuMemAlloc+cuMemFree", str(unavailable),
                          target=target)
            return
        anchor = "in-process cuMemAlloc+cuMemFree 1 MiB"
        note = None
    else:
        local = LocalSim()
        anchor = "in-process sim driver mem_alloc+mem_free 1 MiB (cuctxd.daemon.backends.sim.SimDriver)"
        target = None
        note = "sim backend: the anchor is the sim driver, not the GPU; the target (< 1.0) is judged on cuda only"
    try:
        def local_pair() -> None:
            local.free(local.alloc(SIZE))

        with contextlib.ExitStack() as stack:
            client = stack.enter_context(bench.client())

            def daemon_pair() -> None:
                client.alloc(SIZE).free()

            echo = stack.enter_context(RawClient(bench.anchor_endpoint("ipc")))

            def echo_pair() -> None:
                echo.ping()
                echo.ping()

            calls = {"daemon": daemon_pair, "local": local_pair, "floor": echo_pair}
            shareable = alloc_supports_shareable()
            if shareable:
                calls["shareable"] = lambda: client.alloc(SIZE, shareable=True).free()
            samples = interleaved(calls, s.alloc_pairs, warmup=max(10, s.alloc_pairs // 10))

            def daemon_batch() -> None:
                with client.pipeline() as p:
                    allocs = [p.send(wire.alloc(client, Buffer, SIZE, None, False)) for _ in range(BATCH)]
                with client.pipeline() as p:
                    for call in allocs:
                        p.send(wire.free(call.result()))

            batches = time_calls(daemon_batch, max(5, s.alloc_pairs // BATCH))
    finally:
        if isinstance(local, LocalSim):
            local.close()
    anchor_us = us(median(samples["local"]))
    yield measured(FIGURE, "alloc+free 1 MiB (default alloc)", us(median(samples["daemon"])), "us", anchor,
                   anchor_us, target=target, note=note or f"median of {len(samples['daemon'])} pairs")
    yield measured(FIGURE, f"alloc+free 1 MiB, {BATCH} pipelined, per pair", us(median(batches) / BATCH), "us",
                   anchor, anchor_us, target=target,
                   note=note or f"{BATCH} allocs without waiting, then their frees; median of {len(batches)}")
    yield measured(FIGURE, "floor: two bare-echo round trips (ipc)", us(median(samples["floor"])), "us", anchor,
                   anchor_us, note="what any alloc+free pair one by one costs over IPC before the daemon does anything")
    yield measured(FIGURE, "alloc+free 1 MiB (default alloc), vs the floor", us(median(samples["daemon"])), "us",
                   "two bare-echo round trips (ipc)", us(median(samples["floor"])),
                   target=None if note else "<= 1.1", note=note or "what the daemon adds to two round trips")
    if shareable:
        shareable_us = us(median(samples["shareable"]))
        yield measured(FIGURE, "alloc+free 1 MiB (shareable=True)", shareable_us, "us", anchor, anchor_us,
                       note="exportable memory through the daemon: a VMM allocation of its own where the device "
                            "has VMM")
        yield measured(FIGURE, "alloc+free 1 MiB (shareable=True), vs the default alloc", shareable_us, "us",
                       "alloc+free 1 MiB (default alloc)", us(median(samples["daemon"])),
                       target=None if note else "<= 2.0",
                       note=note or "what exportable memory costs over the private pool's, one by one")
    else:
        yield skipped(FIGURE, "alloc+free 1 MiB (shareable=True)", "us", anchor,
                      "client.Client.alloc has no shareable= argument yet")
