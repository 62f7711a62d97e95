"""Figure 1: ping round trip p50/p99 over ipc:// and tcp://, against a bare ROUTER echo.

The daemon is reached through ``client.Client`` (the path users take); the echo
through a bare DEALER doing the same msgpack encode and decode. A third series,
the same bare DEALER against the daemon, splits the client library's share out.
The three are timed in alternating blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from bench.anchors import RawClient
from bench.records import Figure, measured
from bench.run import Bench
from bench.stats import interleaved, median, percentile, us

FIGURE = 1
TITLE = "ping round trip"
TRANSPORTS = ("ipc", "tcp")


def run(bench: Bench) -> Iterator[Figure]:
    s = bench.settings
    for transport in TRANSPORTS:
        with bench.client(transport) as client, RawClient(bench.anchor_endpoint(transport)) as echo, \
                RawClient(bench.endpoint(transport)) as raw:
            samples = interleaved({"daemon": client.ping, "echo": echo.ping, "raw": raw.ping},
                                  s.ping_samples, s.warmup)
        daemon, bare, raw_daemon = samples["daemon"], samples["echo"], samples["raw"]
        anchor = f"bare pyzmq ROUTER echo + msgpack, {transport}"
        note = f"{len(daemon)} round trips each, client.Client vs a bare DEALER"
        yield measured(FIGURE, f"ping p50 ({transport})", us(median(daemon)), "us", f"{anchor}, p50",
                       us(median(bare)), target="<= 1.15", note=note)
        yield measured(FIGURE, f"ping p99 ({transport})", us(percentile(daemon, 99)), "us", f"{anchor}, p99",
                       us(percentile(bare, 99)), note=note)
        yield measured(FIGURE, f"ping p50 ({transport}), bare DEALER to the daemon", us(median(raw_daemon)),
                       "us", f"{anchor}, p50", us(median(bare)),
                       note="the daemon without the client library: the same DEALER and msgpack work as the echo's")
