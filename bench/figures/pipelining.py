"""Figure 7: 1,000 writes of 64 bytes one by one, against the same writes through ``Client.pipeline()``.

``with client.pipeline() as p: futures = [p.write(buffer, data, offset=...)]``:
requests go out without waiting, and every reply is in when the block ends.
Reported as writes per second; the ratio is the pipelining gain. Skipped while
the client has no ``pipeline()``.
"""

from __future__ import annotations

from collections.abc import Iterator

from bench.anchors import pattern
from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.stats import interleaved, median

FIGURE = 7
TITLE = "pipelining gain"
WRITE_SIZE = 64


def run(bench: Bench) -> Iterator[Figure]:
    from cuctxd.client import Client

    count = bench.settings.pipeline_writes
    name = f"{count} x {WRITE_SIZE} B writes, pipelined (ipc)"
    anchor = "the same writes one by one"
    if not hasattr(Client, "pipeline"):
        yield skipped(FIGURE, name, "writes/s", anchor, "client has no pipeline()")
        return
    data = pattern(WRITE_SIZE)
    with bench.client() as client:
        buffer = client.alloc(WRITE_SIZE * count)

        def one_by_one() -> None:
            for i in range(count):
                buffer.write(data, offset=i * WRITE_SIZE)

        def pipelined() -> None:
            with client.pipeline() as pipe:
                futures = [pipe.write(buffer, data, offset=i * WRITE_SIZE) for i in range(count)]
            for future in futures:
                future.result()

        buffer.fill(0)
        pipelined()
        if buffer.read() != data * count:
            raise AssertionError("pipelined writes did not land where they were addressed")
        repeats = bench.settings.pipeline_repeats
        samples = interleaved({"one_by_one": one_by_one, "pipelined": pipelined}, repeats, warmup=1,
                              blocks=repeats)
    rate = {k: count / (median(v) / 1e9) for k, v in samples.items()}
    yield measured(FIGURE, name, rate["pipelined"], "writes/s", anchor, rate["one_by_one"],
                   note=f"median of {repeats} batches of {count}; the ratio is the gain")
