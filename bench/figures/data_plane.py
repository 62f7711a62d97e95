"""Figure 8: the data plane — transfers against their floors, host buffers, opening shares, stream order.

* Latency of ``write``/``read_into`` at 64 KiB and 1 MiB (the client's default path: the staging ring
  at these sizes over ipc://), against the floor of one bare-echo round trip plus the in-process
  pageable copy of the same size, both measured here; the socket path (one payload frame) beside it.
* ``write`` from and ``read_into`` a host buffer of 64 MiB (DMA, no bytes on the socket), against
  in-process pinned ``cuMemcpyHtoD``/``DtoH`` of the same size.
* ``open_shared`` of a shareable buffer again, against one bare-echo round trip: a pool share whose pool this
  process has imported (a device without VMM) is judged; a VMM share, which every open imports from a new fd
  (the fd channel, ``cuMemImportFromShareableHandle``, ``cuMemMap``), is reported without a target.
* Stream-ordered ``alloc_async``+``free_async`` of 1 MiB in a loop, against in-process
  ``cuMemAlloc``+``cuMemFree``.

Targets are judged on cuda only (on sim the anchors are not a GPU's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.anchors import RawClient, pattern
from bench.cuda_local import LocalCuda, LocalDriverUnavailable, LocalSim
from bench.records import Figure, measured
from bench.run import Bench
from bench.stats import gbps, interleaved, median, time_calls, us
from cuctxd.client.wire import build as wire

FIGURE = 8
TITLE = "data plane"
_MiB = 1 << 20
#: Pairs per timed stream-ordered loop.
LOOP = 1000


def _label(size: int) -> str:
    return f"{size // _MiB} MiB" if size >= _MiB else f"{size >> 10} KiB"


def run(bench: Bench) -> Iterator[Figure]:
    local: LocalCuda | LocalSim
    try:
        local, note = bench.local_cuda(), None
    except LocalDriverUnavailable:
        local, note = LocalSim(), "sim backend: anchors are the sim driver in process; targets judged on cuda only"
    try:
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(bench.client())
            echo = stack.enter_context(RawClient(bench.anchor_endpoint("ipc")))
            yield from _latency(bench, client, echo, local, note)
            yield from _host_buffers(bench, client, local, note)
            yield from _open_shared(bench, client, echo, note)
            yield from _stream_ordered(bench, client, local, note)
    finally:
        if isinstance(local, LocalSim):
            local.close()


def _target(note: str | None, target: str) -> str | None:
    return None if note else target


def _latency(bench: Bench, client: Any, echo: RawClient, local: LocalCuda | LocalSim,
             note: str | None) -> Iterator[Figure]:
    for size in (64 << 10, _MiB):
        count = bench.settings.bandwidth_reps.get(size, 100)
        t = _latency_at(size, count, client, echo, local)
        label = _label(size)
        for direction, copy in (("write", "h2d"), ("read", "d2h")):
            floor = t["echo"] + t[copy]
            anchor = (f"one bare-echo round trip ({t['echo']:.1f} us) + in-process pageable "
                      f"{'cuMemcpyHtoD' if copy == 'h2d' else 'cuMemcpyDtoH'} {label} ({t[copy]:.1f} us)")
            yield measured(FIGURE, f"{direction} {label} latency (ipc, default path)", t[direction], "us", anchor,
                           floor, target=_target(note, "<= 1.3"), note=note or f"median of {count}")
            yield measured(FIGURE, f"{direction} {label} latency (ipc, one payload frame)", t[f"{direction} frame"],
                           "us", anchor, floor, note=note or "the socket path, for the break-even point")


def _latency_at(size: int, count: int, client: Any, echo: RawClient, local: LocalCuda | LocalSim) -> dict[str, float]:
    """Median microseconds of each way of moving ``size`` bytes, timed in alternating blocks."""
    payload = pattern(size)
    out = bytearray(size)
    buffer = client.alloc(size)
    ptr = local.alloc(size)
    calls: dict[str, Callable[[], object]] = {
        "write": lambda: buffer.write(payload),
        "read": lambda: buffer.read_into(out),
        "write frame": lambda: client.run(wire.write_frame(buffer, payload, 0, None)),
        "read frame": lambda: client.run(wire.read_into(buffer, out, 0, None)),
        "echo": echo.ping,
        "h2d": lambda: local.htod(ptr, payload, size),
        "d2h": lambda: local.dtoh(out, ptr, size),
    }
    try:
        samples = interleaved(calls, count, warmup=5)
    finally:
        local.free(ptr)
        buffer.free()
    return {name: us(median(ns)) for name, ns in samples.items()}


def _host_buffers(bench: Bench, client: Any, local: LocalCuda | LocalSim, note: str | None) -> Iterator[Figure]:
    size = 64 * _MiB
    count = bench.settings.bandwidth_reps.get(size, 5)
    if isinstance(local, LocalCuda):
        host_local = local.pinned(size)
        anchor_kind = "in-process pinned"
    else:
        host_local = memoryview(bytearray(size))
        anchor_kind = "in-process (sim)"
    host = client.host_alloc(size)
    buffer = client.alloc(size)
    ptr = local.alloc(size)
    try:
        memoryview(host)[:] = pattern(size)
        calls: dict[str, Callable[[], object]] = {
            "write": lambda: buffer.write(host),
            "read": lambda: buffer.read_into(host),
            "h2d": lambda: local.htod(ptr, host_local, size),
            "d2h": lambda: local.dtoh(host_local, ptr, size),
        }
        samples = interleaved(calls, count, warmup=1, blocks=min(count, 5))
    finally:
        local.free(ptr)
        buffer.free()
        host.free()
    rate = {name: gbps(size, median(ns)) for name, ns in samples.items()}
    for direction, copy, call in (("write", "h2d", "cuMemcpyHtoD"), ("read", "d2h", "cuMemcpyDtoH")):
        yield measured(FIGURE, f"{direction} 64 MiB from/to a host buffer (DMA)", rate[direction], "GB/s",
                       f"{anchor_kind} {call} 64 MiB", rate[copy], target=_target(note, ">= 0.8"),
                       note=note or f"median of {count}")


def _open_shared(bench: Bench, client: Any, echo: RawClient, note: str | None) -> Iterator[Figure]:
    count = max(50, bench.settings.alloc_pairs // 4)
    buffer = client.alloc(_MiB, shareable=True)
    descriptor = client.export(buffer)
    opened: list[Any] = []

    def open_one() -> None:
        opened.append(client.open_shared(descriptor))

    try:
        client.open_shared(descriptor).close()  # imports a pool share's pool: what every later open skips
        samples: list[int] = []
        echo_samples: list[int] = []
        for _ in range(5):
            samples.extend(time_calls(open_one, count // 5))
            for share in opened:
                share.close()
            opened.clear()
            echo_samples.extend(time_calls(echo.ping, count // 5))
    finally:
        buffer.free()
    if descriptor.mechanism == "pool":
        name, target, what = "open_shared, pool already imported (pool)", "<= 1.2", "hold + cuMemPoolImportPointer"
    else:
        name, target, what = (f"open_shared again ({descriptor.mechanism})", None,
                              "hold + its fd over the fd channel + import and map (no target yet)")
    yield measured(FIGURE, name, us(median(samples)), "us", "one bare-echo round trip (ipc)", us(median(echo_samples)),
                   target=target and _target(note, target), note=note or f"median of {len(samples)}: {what}")


def _stream_ordered(bench: Bench, client: Any, local: LocalCuda | LocalSim, note: str | None) -> Iterator[Figure]:
    rounds = 5 if bench.settings.quick else 20

    def daemon_loop() -> None:
        for _ in range(LOOP):
            client.free_async(client.alloc_async(_MiB))
        client.synchronize()

    def local_loop() -> None:
        for _ in range(LOOP):
            local.free(local.alloc(_MiB))

    daemon_loop()
    daemon_ns: list[int] = []
    local_ns: list[int] = []
    for _ in range(rounds):
        for loop, into in ((daemon_loop, daemon_ns), (local_loop, local_ns)):
            start = time.perf_counter_ns()
            loop()
            into.append((time.perf_counter_ns() - start) // LOOP)
    yield measured(FIGURE, "alloc_async+free_async 1 MiB in a loop, per pair", us(median(daemon_ns)), "us",
                   "in-process cuMemAlloc+cuMemFree 1 MiB", us(median(local_ns)), target=_target(note, "<= 0.5"),
                   note=note or f"{LOOP} pairs then synchronize; median of {rounds} loops")
