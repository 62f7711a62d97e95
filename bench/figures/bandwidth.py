"""Figure 4: write and read bandwidth through the daemon for 64 KiB, 1 MiB and 64 MiB.

``Buffer.write(bytes)`` and ``Buffer.read_into(bytearray)`` over ipc:// (through the client's staging
ring from ``RING_MIN_BYTES`` up: its copy runs on several threads beside the daemon's DMA), against
(a) pageable ``cuMemcpyHtoD``/``cuMemcpyDtoH`` in this process (cuda only) and
(b) the same bytes through bare ZeroMQ to the anchor's ``sink``/``source``
(both backends). GB/s is 10^9 bytes per second over the median transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from bench.anchors import RawClient, pattern
from bench.cuda_local import LocalCuda, LocalDriverUnavailable
from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.stats import gbps, interleaved, median

FIGURE = 4
TITLE = "write/read bandwidth"
_MiB = 1 << 20


def _label(size: int) -> str:
    return f"{size // _MiB} MiB" if size >= _MiB else f"{size >> 10} KiB"


def run(bench: Bench) -> Iterator[Figure]:
    s = bench.settings
    sizes = sorted(s.bandwidth_reps)
    data = pattern(max(sizes))
    local: LocalCuda | None
    try:
        local, local_reason = bench.local_cuda(), None
    except LocalDriverUnavailable as unavailable:
        local, local_reason = None, str(unavailable)
    with bench.client() as client, RawClient(bench.anchor_endpoint("ipc")) as bare:
        buffer = client.alloc(max(sizes))
        for size in sizes:
            reps = s.bandwidth_reps[size]
            rate = _measure(buffer, bare, local, data[:size], reps)
            yield from _records(size, rate, local_reason, reps)


def _measure(buffer: Any, bare: RawClient, local: LocalCuda | None, payload: bytes, reps: int) -> dict[str, float]:
    """GB/s of each way of moving ``payload``, timed in alternating blocks; checks the daemon's copy."""
    size = len(payload)
    out = bytearray(size)
    calls: dict[str, Callable[[], object]] = {
        "write": lambda: buffer.write(payload),
        "read": lambda: buffer.read_into(out),
        "sink": lambda: bare.call("sink", payload=payload),
        "source": lambda: bare.call("source", {"size": size}, into=out),
    }
    ptr = local.alloc(size) if local is not None else 0
    try:
        if local is not None:
            calls["h2d"] = lambda: local.htod(ptr, payload, size)
            calls["d2h"] = lambda: local.dtoh(out, ptr, size)
        samples = interleaved(calls, reps, warmup=2, blocks=min(reps, 5))
    finally:
        if local is not None:
            local.free(ptr)
    out[:] = bytes(size)
    buffer.read_into(out)
    if out != payload:
        raise AssertionError(f"the daemon buffer read back differs from what was written ({size} bytes)")
    return {name: gbps(size, median(ns)) for name, ns in samples.items()}


def _records(size: int, rate: dict[str, float], local_reason: str | None, reps: int) -> Iterator[Figure]:
    label = _label(size)
    note = f"median of {reps} transfers"
    for direction, op, anchor_op, zmq_op, zmq_anchor in (
        ("write", "write", "h2d", "sink", "bare ZeroMQ send of the same bytes to a sink process, ipc"),
        ("read", "read", "d2h", "source", "bare ZeroMQ receive of the same bytes from a source process, ipc"),
    ):
        local_anchor = f"in-process pageable {'cuMemcpyHtoD' if direction == 'write' else 'cuMemcpyDtoH'} {label}"
        target = {"write": ">= 2.0", "read": ">= 1.2"}[direction] if size == 64 * _MiB else None
        name = f"{direction} {label} (ipc), vs in-process copy"
        if local_reason is None:
            yield measured(FIGURE, name, rate[op], "GB/s", local_anchor, rate[anchor_op], target=target, note=note)
        else:
            yield skipped(FIGURE, name, "GB/s", local_anchor, local_reason, target=target)
        yield measured(FIGURE, f"{direction} {label} (ipc), vs bare ZeroMQ", rate[op], "GB/s", zmq_anchor,
                       rate[zmq_op], note=note)
