"""Figure 2: requests per second with 1, 4 and 8 client processes, against the bare echo with as many.

Two ops: ``ping`` (answered by the daemon's front thread) and a 64-byte
``read`` (through device 0's worker and the driver); the echo answers the read
with 64 payload bytes. Clients are spawned processes over ipc://, all started
on one signal; the rate is the sum of each process's own rate. Daemon and echo
rounds alternate, and each side reports its median round.
"""

from __future__ import annotations

from collections.abc import Iterator

from bench.records import Figure, measured
from bench.run import Bench
from bench.stats import median

FIGURE = 2
TITLE = "small-op throughput"
READ_SIZE = 64


def run(bench: Bench) -> Iterator[Figure]:
    s = bench.settings
    pool = bench.pool()
    most = max(s.client_counts)
    series: tuple[tuple[str, str, dict[str, int], str, dict[str, int], str], ...] = (
        ("ping", "daemon_ping", {}, "echo_ping", {}, "bare echo"),
        (f"{READ_SIZE} B read", "daemon_read", {"size": READ_SIZE}, "echo_read", {"size": READ_SIZE},
         f"bare echo replying {READ_SIZE} B"),
    )
    for label, daemon_task, daemon_args, echo_task, echo_args, anchor in series:
        for clients in s.client_counts:
            daemon_rates, echo_rates = [], []
            for _ in range(s.throughput_rounds):  # alternating, so drift on the machine hits both alike
                daemon_rates.append(pool.run(clients, daemon_task, s.throughput_seconds,
                                             endpoint=bench.endpoint("ipc"), **daemon_args))
                echo_rates.append(pool.run(clients, echo_task, s.throughput_seconds,
                                           endpoint=bench.anchor_endpoint("ipc"), **echo_args))
            plural = "es" if clients > 1 else ""
            yield measured(FIGURE, f"{label} throughput, {clients} client process{plural} (ipc)",
                           median(daemon_rates), "req/s", f"{anchor}, {clients} client process{plural}",
                           median(echo_rates), target=">= 0.85" if clients == most else None,
                           note=f"median of {s.throughput_rounds} alternating rounds of {s.throughput_seconds:g} s; "
                                f"{pool.size} spawned processes")
