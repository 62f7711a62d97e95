"""Where a ``cuctx load`` spends its time: one or more loads in this process, each stage timed.

``python -m bench.load_stages ENDPOINT CHECKPOINT [--loads N] [--no-digest]`` loads the checkpoint as a
layout (unpublished after each load) and prints one JSON line per load: its seconds and GB/s, and for each
stage how many times it ran, its total seconds (summed over threads) and when it first began and last ended,
in seconds from the load's start. The stages are the load's own functions, wrapped for the run:
``read_checkpoint``, ``lookup`` (is the name in use), ``host_alloc`` (the load ring), ``fill`` (a reader
filling a slot from the page cache, hashing included), ``direct_step`` (a reader's ``O_DIRECT`` step of a
chunk not in the page cache; the chunk's last one places and hashes it) and ``hash`` (one digest leaf),
each request the load sends (``send:OP``) and waits for (``wait:OP``), ``local`` (the calling thread
waiting for a reader), ``publish``. It is how issue 28's GPU profiles were taken (with py-spy on the daemon
beside it); run it in a fresh process per load to see a fresh client's costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

from cuctxd import Client
from cuctxd.client.data_plane import file_reads
from cuctxd.client.tensors import safetensors_load
from cuctxd.client.wire.build import Send, Wait
from cuctxd.protos import digests

NAME = "bench-load-stages"


class Stages:
    """Spans of each stage of the load running now (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[tuple[str, float, float]] = []

    def add(self, stage: str, start: float) -> None:
        with self._lock:
            self.spans.append((stage, start, time.perf_counter()))

    def timed(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(stage, start)
        return run

    def summary(self, began: float) -> dict[str, dict[str, float]]:
        found: dict[str, dict[str, float]] = {}
        for stage, start, end in self.spans:
            entry = found.setdefault(stage, {"count": 0, "seconds": 0.0, "first": start - began, "last": 0.0})
            entry["count"] += 1
            entry["seconds"] += end - start
            entry["first"] = min(entry["first"], start - began)
            entry["last"] = max(entry["last"], end - began)
        return {stage: {key: round(value, 5) for key, value in entry.items()} for stage, entry in found.items()}


def _timed_plan(stages: Stages, plan: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Any]:
    """The load's pipeline plan with each step it yields timed, sends and waits by their op."""
    ops: dict[int, str] = {}

    @functools.wraps(plan)
    def timed(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        steps = plan(*args, **kwargs)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Send):
                    stage = f"send:{step.request.op}"
                elif isinstance(step, Wait):
                    stage = f"wait:{ops.get(id(step.sent), '?')}"
                else:
                    stage = "local"
                start = time.perf_counter()
                try:
                    value = yield step
                except BaseException as error:  # the plan's own cleanup steps follow, timed the same
                    stages.add(stage, start)
                    step = steps.throw(error)
                    continue
                stages.add(stage, start)
                if isinstance(step, Send):
                    ops[id(value)] = step.request.op
                step = steps.send(value)
        except StopIteration as stop:
            return stop.value
    return timed


@contextmanager
def instrumented(stages: Stages, client: Client) -> Iterator[None]:
    """The load's functions wrapped for the ``with`` block, put back after it."""
    wrapped: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, replacement: Any) -> None:
        wrapped.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    wrap(safetensors_load, "read_checkpoint", stages.timed("read_checkpoint", safetensors_load.read_checkpoint))
    wrap(safetensors_load, "_published", stages.timed("lookup", safetensors_load._published))
    wrap(safetensors_load, "publish_filled", stages.timed("publish", safetensors_load.publish_filled))
    wrap(file_reads._Reader, "_fill_buffered", stages.timed("fill", file_reads._Reader._fill_buffered))
    wrap(file_reads._DirectRead, "step", stages.timed("direct_step", file_reads._DirectRead.step))
    wrap(digests, "leaf", stages.timed("hash", digests.leaf))
    wrap(file_reads, "_pipeline", _timed_plan(stages, file_reads._pipeline))
    wrap(client, "host_alloc", stages.timed("host_alloc", client.host_alloc))
    try:
        yield
    finally:
        for owner, name, original in reversed(wrapped):
            if owner is client:
                delattr(client, name)
            else:
                setattr(owner, name, original)


def load_stages(client: Client, path: str, *, digest: bool = True) -> dict[str, Any]:
    """One load of ``path``, timed by stage (then unpublished)."""
    stages = Stages()
    size = sum(os.path.getsize(shard.path) for shard in safetensors_load.read_checkpoint(path).shards)
    with instrumented(stages, client):
        began = time.perf_counter()
        safetensors_load.load_safetensors(client, path, NAME, device=0, digest=digest)
        seconds = time.perf_counter() - began
    client.unpublish(NAME)
    return {"seconds": round(seconds, 5), "gbps": round(size / seconds / 1e9, 3), "stages": stages.summary(began)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_stages", description=__doc__.splitlines()[0])
    parser.add_argument("endpoint", help="the daemon's endpoint")
    parser.add_argument("checkpoint", help="a .safetensors file, a directory of shards or an index")
    parser.add_argument("--loads", type=int, default=1, help="loads in this process (default 1)")
    parser.add_argument("--no-digest", action="store_true", help="load without digests")
    args = parser.parse_args(argv)
    with Client(args.endpoint, timeout=600) as client:
        client.ping()
        for _ in range(args.loads):
            print(json.dumps(load_stages(client, args.checkpoint, digest=not args.no_digest)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
