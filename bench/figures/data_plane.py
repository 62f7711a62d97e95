"""Figure 8: the data plane — transfers against their floors, host buffers, opening shares, stream order.

* Latency of ``write``/``read_into`` at 64 KiB and 1 MiB (the client's default path: the staging ring
  at these sizes over ipc://), against the floor of one bare-echo round trip plus the in-process
  pageable copy of the same size, both measured here; the socket path (one payload frame) beside it.
* ``write`` from and ``read_into`` a host buffer of 64 MiB (DMA, no bytes on the socket), against
  in-process pinned ``cuMemcpyHtoD``/``DtoH`` of the same size.
* ``open_shared`` of a shareable buffer again while another opening of it is alive in this process, against
  one bare-echo round trip (judged): a VMM share's mapping (or a pool share's import) is reused, so it is the
  hold's round trip; the open of a VMM share nothing here maps (its fd over the fd channel,
  ``cuMemImportFromShareableHandle``, ``cuMemMap``) is reported beside it without a target.
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
    """Opens of a share while another opening of it is alive in this process (what a user's second open is):
    judged; opens of a share nothing here maps (the fd, its import and map): reported."""
    count = max(50, bench.settings.alloc_pairs // 4)
    buffer = client.alloc(_MiB, shareable=True)
    descriptor = client.export(buffer)
    opened: list[Any] = []

    def open_one() -> None:
        opened.append(client.open_shared(descriptor))

    def close_opened() -> None:
        for share in opened:
            share.close()
        opened.clear()

    try:
        client.open_shared(descriptor).close()  # imports a pool share's pool: what every later open skips
        again: list[int] = []
        first: list[int] = []
        echo_samples: list[int] = []
        for _ in range(5):
            with client.open_shared(descriptor):
                again.extend(time_calls(open_one, count // 5))
                close_opened()
            for _ in range(count // 5):
                first.extend(time_calls(open_one, 1))
                close_opened()
            echo_samples.extend(time_calls(echo.ping, count // 5))
    finally:
        close_opened()
        buffer.free()
    mechanism, echo_us = descriptor.mechanism, us(median(echo_samples))
    what = {"pool": "hold + cuMemPoolImportPointer once per process", "vmm": "hold; the mapping reused"}
    yield measured(FIGURE, f"open_shared again, one open alive ({mechanism})", us(median(again)), "us",
                   "one bare-echo round trip (ipc)", echo_us, target=_target(note, "<= 1.2"),
                   note=note or f"median of {len(again)}: {what.get(mechanism, 'hold + IPC open')}")
    if mechanism == "vmm":
        yield measured(FIGURE, "open_shared, nothing mapped here (vmm)", us(median(first)), "us",
                       "one bare-echo round trip (ipc)", echo_us, target=None,
                       note=note or f"median of {len(first)}: hold + its fd over the fd channel + import and map")


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
