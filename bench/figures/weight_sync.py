"""Figure 10: RL weight sync — a trainer hands each new version of its weights to 4 engines on one GPU.

A bf16 state dict of :data:`TENSORS` tensors (7 GiB on cuda; 256 MiB on the sim, 64 MiB with ``--quick``) lives
in a trainer process; :data:`ENGINES` engine processes hold the previous version. Timed: from the trainer's call
to the last engine having computed with the new version (it reads a value the trainer wrote into it), the
median of the rounds after the first (the first in the note). The ways (:mod:`bench.weight_sync_roles`):

* zero-copy: ``publish_version`` (device to device in the trainer into the name's spare, an older version's
  buffer that the trainer and the engines keep mapped: nothing allocated or mapped after the first rounds),
  engines ``wait_version`` in the daemon, ``refresh()`` and compute on the new version, closing the old one after;
* copy: the same, each engine copying the version into parameters of its own (``copy_into``);
* anchors, in the same run (cuda and torch only): one CUDA IPC handle per tensor
  (``torch.multiprocessing.reductions.reduce_tensor``), rebuilt in each engine and copied into its parameters,
  as vime does; the tensors flattened into 1 GiB buckets, one handle each, copied the same way, as slime and
  SkyRL do.

Also reported for each way: the GPU memory it holds at its peak (``cuMemGetInfo`` through the daemon, taken when
every engine has computed with the new version and before anything is let go), beyond what the processes held
before the weights were made, against the state dict's size. On the sim only the daemon's memory is counted
(the trainer's and engines' arrays are host memory).

Where each way's seconds go, in the same rounds (no targets): a row per stage, the median of the rounds
after the first, against the way's whole round (:data:`bench.weight_sync_roles.STAGES` says what each covers;
an engine stage is the slowest engine's of its round), also printed one line each as ``fig10 WAY STAGE``.
Two more: ``engines woken after publish returned`` (the first engine's ``wait_version`` answer, from the
trainer's hand-over returning; negative where it came first) and ``last engine woken, from the call``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.weight_sync_roles import NAME, STAGES, run_engine, run_trainer
from cuctxd.protos.errors import NotFound

FIGURE = 10
TITLE = "weight sync: trainer to 4 engines"
ENGINES = 4
TENSORS = 300
#: Rounds of each way: the first (reported in the note) and those whose median is the figure.
ROUNDS = 4
QUICK_ROUNDS = 2
#: Seconds a process may take to answer one command (starting torch and CUDA, making 7 GiB, a round).
ANSWER_S = 600.0
WAYS = ("zero-copy", "copy", "per-tensor", "buckets")
ANCHORS = ("per-tensor", "buckets")
GiB = 1 << 30


@dataclass
class Way:
    """One way measured: seconds of the first round, the median of the others, and the peak of GPU memory."""

    first: float
    seconds: float
    peak: int
    stages: dict[str, float]


def run(bench: Bench) -> Iterator[Figure]:
    quick = bench.settings.quick
    total = (64 << 20) if quick else (7 * GiB) if bench.backend == "cuda" else (256 << 20)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    size_text = f"{total / GiB:.0f} GiB" if total >= GiB else f"{total >> 20} MiB"
    what = f"bf16 state dict of {size_text} in {TENSORS} tensors, trainer to {ENGINES} engines"
    missing = _missing_torch() if bench.backend == "cuda" else None
    ways: dict[str, Way | str] = {}
    for way in WAYS:
        if missing is not None:
            ways[way] = missing
        elif way in ANCHORS and bench.backend != "cuda":
            ways[way] = f"the anchors share CUDA tensors by IPC handle: needs the cuda backend and torch " \
                        f"(this daemon runs {bench.backend})"
        else:
            ways[way] = _measure(bench, way, total, rounds)
    yield from _figures(what, total, rounds, ways)
    yield from _stage_figures(what, ways)


def _figures(what: str, total: int, rounds: int, ways: dict[str, Way | str]) -> Iterator[Figure]:
    note = (f"median of rounds 2-{rounds} of each way; first rounds: "
            + ", ".join(f"{way} {found.first:.3f} s" for way, found in ways.items() if isinstance(found, Way)))
    zero, copy = ways["zero-copy"], ways["copy"]
    comparisons = [("zero-copy", "per-tensor", "<= 0.1"), ("zero-copy", "buckets", "<= 0.333"),
                   ("copy", "buckets", "<= 1.2")]
    for ours, anchor, target in comparisons:
        found, against = ways[ours], ways[anchor]
        anchor_name = ("one CUDA IPC handle per tensor, copied into each engine's parameters" if anchor == "per-tensor"
                       else "1 GiB buckets over CUDA IPC, copied into each engine's parameters")
        name = f"{what}: {ours} mode, seconds to all engines computing with the new version"
        if isinstance(found, str):
            yield skipped(FIGURE, name, "s", anchor_name, found, target=target)
        elif isinstance(against, str):  # ours measured all the same, its anchor skipped with the reason
            yield measured(FIGURE, name, found.seconds, "s", anchor_name, None, target=target,
                           note=f"{note}; anchor not run: {against}")
        else:
            yield measured(FIGURE, name, found.seconds, "s", anchor_name, against.seconds, target=target, note=note)
    if isinstance(zero, Way) and isinstance(copy, Way):
        yield measured(FIGURE, f"{what}: zero-copy against copy mode, seconds", zero.seconds, "s",
                       "copy mode, the same run", copy.seconds, note=note)
    for way, found in ways.items():
        name = f"{what}: {way}, GPU memory held at its peak"
        target = "<= 3.1" if way == "zero-copy" else None  # the trainer and at most two versions
        if isinstance(found, str):
            yield skipped(FIGURE, name, "GiB", "the state dict's size", found, target=target)
        else:
            yield measured(FIGURE, name, found.peak / GiB, "GiB", "the state dict's size", total / GiB,
                           target=target, note="beyond what the processes held before the weights were made")


def _stage_figures(what: str, ways: dict[str, Way | str]) -> Iterator[Figure]:
    """A row per stage of each way measured (module docstring), printed as it is made."""
    for way, found in ways.items():
        if isinstance(found, str):
            continue
        for stage, seconds in found.stages.items():
            share = seconds / found.seconds if found.seconds else 0.0
            print(f"fig10 {way:<10} {stage:<42} {seconds:8.4f} s {share:6.1%} of {found.seconds:.4f} s", flush=True)
            yield measured(FIGURE, f"{what}: {way}, stage: {stage}, median seconds", seconds, "s",
                           f"{way}'s whole round, seconds", found.seconds, note=STAGES.get(stage, stage))


def _missing_torch() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed: the trainer's state dict and the anchors are torch CUDA tensors"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _measure(bench: Bench, way: str, total: int, rounds: int) -> Way:
    """Start the trainer and the engines of ``way``, time its rounds, stop them (whatever happened)."""
    spawn = multiprocessing.get_context("spawn")
    endpoint, backend = bench.endpoint(), bench.backend
    direct = [spawn.Pipe() for _ in range(ENGINES)] if way in ANCHORS else []
    pipes = [spawn.Pipe() for _ in range(ENGINES + 1)]
    trainer = spawn.Process(target=run_trainer, args=(endpoint, backend, way, total, TENSORS, pipes[0][1],
                                                      [ends[0] for ends in direct]), daemon=True)
    engines = [spawn.Process(target=run_engine, args=(endpoint, backend, way, total, TENSORS, pipes[i + 1][1],
                                                      direct[i][1] if direct else None), daemon=True)
               for i in range(ENGINES)]
    processes = [trainer, *engines]
    to_trainer, to_engines = pipes[0][0], [ends[0] for ends in pipes[1:]]
    try:
        for process in processes:
            process.start()
        for conn in (to_trainer, *to_engines):
            _answer(conn, "up")
        with bench.client() as observer:
            return _rounds(observer, way, rounds, to_trainer, to_engines)
    finally:
        for conn in (to_trainer, *to_engines):
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)
        with bench.client() as client, contextlib.suppress(NotFound):
            client.unpublish(NAME)


def _rounds(observer: Any, way: str, rounds: int, trainer: Connection, engines: list[Connection]) -> Way:
    base = observer.mem_get_info()[0]
    trainer.send(("setup",))
    _answer(trainer, "ready")
    version = 0
    if way not in ANCHORS:  # the engines hold the previous version: publish the first one (not timed)
        trainer.send(("publish", 0))
        _answer(trainer, "published")
        version = 1
    for engine in engines:
        engine.send(("setup",))
        _answer(engine, "ready")
    seconds: list[float] = []
    stages: list[dict[str, float]] = []
    peak = 0
    for index in range(rounds):
        marker = index + 1
        for engine in engines:
            engine.send(("await", version))
            _answer(engine, "waiting")
        trainer.send(("publish", marker))
        published = _answer(trainer, "published")
        done = [_answer(engine, "computed") for engine in engines]
        seconds.append(max(answer[1] for answer in done) - published[1])
        stages.append(_round_stages(published, done))
        if any(answer[2] != marker for answer in done):
            raise RuntimeError(f"{way}: an engine computed with {[a[2] for a in done]}, not the new {marker}")
        peak = max(peak, base - observer.mem_get_info()[0])
        for engine in engines:
            engine.send(("release",))
            _answer(engine, "released")
        version += 1
    counted = stages[1:] or stages
    medians = {stage: statistics.median(round_[stage] for round_ in counted) for stage in counted[0]}
    return Way(seconds[0], statistics.median(seconds[1:] or seconds), peak, medians)


def _round_stages(published: tuple[Any, ...], done: list[tuple[Any, ...]]) -> dict[str, float]:
    """One round's stages: the trainer's, each engine stage's slowest, and when the engines were woken."""
    _, started, ended, trainer = published
    found = dict(trainer)
    for stage in done[0][4]:
        found[stage] = max(answer[4][stage] for answer in done)
    found["engines woken after publish returned"] = min(answer[3] for answer in done) - ended
    found["last engine woken, from the call"] = max(answer[3] for answer in done) - started
    return found


def _answer(conn: Connection, expected: str) -> tuple[Any, ...]:
    """The process's next answer, which must be ``expected``; RuntimeError if it does not come in time or it
    died (its pipe closed)."""
    if not conn.poll(ANSWER_S):
        raise RuntimeError(f"no {expected!r} from a weight-sync process within {ANSWER_S:.0f} s")
    try:
        answer: tuple[Any, ...] = conn.recv()
    except EOFError:
        raise RuntimeError(f"a weight-sync process ended before its {expected!r}") from None
    if answer[0] != expected:
        raise RuntimeError(f"a weight-sync process answered {answer!r}, not {expected!r}")
    return answer
