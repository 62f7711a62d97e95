"""Figure 2: requests per second with 1, 4 and 8 client processes, against a bare echo with as many.

Two ops: ``ping`` (answered by the daemon's front thread) and a 64-byte
``read`` (through device 0's worker and the driver). The read has two anchors:
the bare echo replying with 64 bytes it holds, and the same echo reading those
bytes from a device buffer first with the driver's synchronous device-to-host
copy, as the daemon does (on the daemon's backend, in the echo's process). The
first says what a read costs against no GPU at all; the second what the daemon
adds to the driver call, and carries the target. Clients are spawned processes
over ipc://, all started on one signal; the rate is the sum of each process's
own rate. Daemon and echo rounds alternate, and each side reports its median
round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from bench.anchors import AnchorUnavailable
from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.stats import median

FIGURE = 2
TITLE = "small-op throughput"
READ_SIZE = 64


class Anchor(NamedTuple):
    label: str              # added to the op's name in the figure's name; "" for the first anchor
    name: str
    endpoint: Callable[[Bench], str]
    judged: bool            # whether the target applies at the largest client count


class Op(NamedTuple):
    label: str
    task: str               # the daemon's task and the anchors' (bench.tasks)
    anchor_task: str
    args: dict[str, int]
    anchors: tuple[Anchor, ...]


def _echo(bench: Bench) -> str:
    return bench.anchor_endpoint("ipc")


OPS = (
    Op("ping", "daemon_ping", "echo_ping", {}, (Anchor("", "bare echo", _echo, True),)),
    Op(f"{READ_SIZE} B read", "daemon_read", "echo_read", {"size": READ_SIZE}, (
        Anchor("", f"bare echo replying {READ_SIZE} B", _echo, False),
        Anchor(", vs echo reading the device",
               f"bare echo replying {READ_SIZE} B read from the device (synchronous DtoH copy)",
               Bench.device_anchor_endpoint, True),
    )),
)


def run(bench: Bench) -> Iterator[Figure]:
    s = bench.settings
    pool = bench.pool()
    most = max(s.client_counts)
    for op in OPS:
        endpoints: dict[Anchor, str] = {}
        unavailable: dict[Anchor, str] = {}
        for anchor in op.anchors:
            try:
                endpoints[anchor] = anchor.endpoint(bench)
            except AnchorUnavailable as reason:
                unavailable[anchor] = str(reason)
        for clients in s.client_counts:
            plural = "es" if clients > 1 else ""
            rates: dict[Anchor | None, list[float]] = {None: [], **{anchor: [] for anchor in endpoints}}
            for _ in range(s.throughput_rounds):  # alternating, so drift on the machine hits all alike
                rates[None].append(pool.run(clients, op.task, s.throughput_seconds,
                                            endpoint=bench.endpoint("ipc"), **op.args))
                for anchor, endpoint in endpoints.items():
                    rates[anchor].append(pool.run(clients, op.anchor_task, s.throughput_seconds,
                                                  endpoint=endpoint, **op.args))
            for anchor in op.anchors:
                name = f"{op.label} throughput{anchor.label}, {clients} client process{plural} (ipc)"
                anchor_name = f"{anchor.name}, {clients} client process{plural}"
                target = ">= 0.85" if anchor.judged and clients == most else None
                if anchor in unavailable:
                    yield skipped(FIGURE, name, "req/s", anchor_name, unavailable[anchor], target=target)
                    continue
                yield measured(FIGURE, name, median(rates[None]), "req/s", anchor_name, median(rates[anchor]),
                               target=target,
                               note=f"median of {s.throughput_rounds} alternating rounds of "
                                    f"{s.throughput_seconds:g} s; {pool.size} spawned processes")
