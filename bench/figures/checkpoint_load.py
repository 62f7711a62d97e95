"""Figure 9: a real-shaped bf16 checkpoint loaded onto the GPU, warm and cold, against the loaders people use.

The file (:mod:`bench.checkpoints`): a Llama-shaped model of 255 tensors, 2.79 GB (48 MB with ``--quick``
and on the sim, whose devices are small), written once per run with random bytes to a directory under
/tmp. Every load runs in a fresh process, onto the daemon's device 0, timed from the call to done: its
imports, its CUDA start (``torch``) and its daemon connection come first and are not counted. GB/s are
the file's bytes over the median seconds of :data:`REPEATS` loads (1 with ``--quick``), the loaders
taking turns.

* ``cuctx load`` (:func:`~cuctxd.client.tensors.safetensors_load.load_safetensors`, which returns once
  the layout is published; unpublished after), by default and with ``digest=False``.
* The anchors (cuda only, each skipped with the reason when it cannot run): ``safetensors``
  ``load_file(device="cuda")``; fastsafetensors' ``SafeTensorsFileLoader`` without GDS (``nogds``);
  the Run:ai model streamer's ``SafetensorsStreamer`` to ``cuda``; each followed by
  ``torch.cuda.synchronize()``.
* Warm: the file read once beforehand. Cold: before each load, ``fsync`` and ``POSIX_FADV_DONTNEED``,
  and ``mincore`` says how much of the file was still cached; when eviction does not take (a tmpfs),
  the cold figures are skipped with what it found.

Targets (issue 28): warm >= 3x ``load_file``; cold >= 1.2x the fastest other loader of the same run;
the digests' cost: seconds with them / seconds without <= 1.10.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bench.checkpoints import FULL_MODEL, QUICK_MODEL, evict, read_through, resident_fraction, write_checkpoint
from bench.records import Figure, measured, skipped
from bench.run import Bench
from bench.stats import median
from cuctxd.client.tensors.safetensors_load import load_safetensors

FIGURE = 9
TITLE = "a real-shaped checkpoint loaded, warm and cold"
REPEATS = 3
#: Share of the file that may still be cached after eviction for a load to count as cold.
COLD_RESIDENT = 0.05
_LAYOUT = "bench-checkpoint"
OURS, OURS_NO_DIGEST = "cuctx", "cuctx-no-digest"
#: The other loaders: what each needs importable, and how the figures name it.
ANCHORS = {
    "safetensors": ("safetensors.torch", 'safetensors load_file(device="cuda") + torch.cuda.synchronize()'),
    "fastsafetensors": ("fastsafetensors", "fastsafetensors SafeTensorsFileLoader (nogds) + synchronize"),
    "runai": ("runai_model_streamer", "Run:ai model streamer SafetensorsStreamer to cuda + synchronize"),
}

#: One timed load: argv is the loader, the file, the daemon's endpoint; it prints "seconds S" last.
_LOAD = """
import sys, time
loader, path, endpoint = sys.argv[1:4]
if loader in ("cuctx", "cuctx-no-digest"):
    from cuctxd import Client
    from cuctxd.client.tensors.safetensors_load import load_safetensors
    options = {"digest": False} if loader == "cuctx-no-digest" else {}
    with Client(endpoint, timeout=600) as client:
        client.ping()
        start = time.perf_counter()
        load_safetensors(client, path, "bench-checkpoint", device=0, **options)
        took = time.perf_counter() - start
        client.unpublish("bench-checkpoint")
else:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    if loader == "safetensors":
        from safetensors.torch import load_file
        start = time.perf_counter()
        tensors = load_file(path, device="cuda")
    elif loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader
        files = SafeTensorsFileLoader(None, "cuda:0", nogds=True)
        start = time.perf_counter()
        files.add_filenames({0: [path]})
        buffers = files.copy_files_to_device()
        tensors = {key: buffers.get_tensor(key) for key in files.get_keys()}
    else:
        from runai_model_streamer import SafetensorsStreamer
        with SafetensorsStreamer() as streamer:
            start = time.perf_counter()
            streamer.stream_file(path, device="cuda")
            tensors = dict(streamer.get_tensors())
    torch.cuda.synchronize()
    took = time.perf_counter() - start
print("seconds", took, flush=True)
"""


class LoaderFailed(RuntimeError):
    """A loader's process exited without a time; the message is the last line it said (the exception)."""


@dataclass
class Loads:
    """The seconds of each loader in one state of the page cache, or why a loader has none."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def gbps(self, loader: str, size: int) -> float | None:
        times = self.seconds.get(loader)
        return size / median(times) / 1e9 if times else None


def _time_load(bench: Bench, loader: str, path: str) -> float:
    env = dict(os.environ)
    uuid = bench.devices[0].uuid if bench.backend == "cuda" and bench.devices else None
    if uuid and uuid.startswith("GPU-"):
        env["CUDA_VISIBLE_DEVICES"] = uuid  # the anchors' cuda:0 is the daemon's device 0
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _LOAD, loader, path, bench.endpoint()],
                          capture_output=True, text=True, timeout=600, env=env)
    last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if not last or not last[0].startswith("seconds "):
        said = (done.stderr.strip() or done.stdout.strip() or "nothing").splitlines()[-1]
        raise LoaderFailed(f"exited {done.returncode}: {said}")
    return float(last[0].split()[1])


def _measure(bench: Bench, path: str, loaders: list[str], repeats: int, before: Callable[[], None]) -> Loads:
    """``repeats`` rounds, each loader once per round; an anchor that fails is dropped with why, ours raises."""
    loads = Loads()
    for _ in range(repeats):
        for loader in loaders:
            if loader in loads.unavailable:
                continue
            before()
            try:
                took = _time_load(bench, loader, path)
            except LoaderFailed as failure:
                if loader in (OURS, OURS_NO_DIGEST):
                    raise
                loads.unavailable[loader] = f"{loader} failed: {failure}"
                continue
            loads.seconds.setdefault(loader, []).append(took)
    return loads


def _anchor_unavailable(bench: Bench) -> dict[str, str]:
    """Why each anchor cannot run here (absent when it can)."""
    missing: dict[str, str] = {}
    for anchor, (module, _) in ANCHORS.items():
        if bench.backend != "cuda":
            missing[anchor] = f"needs the cuda backend; the daemon runs {bench.backend}"
        elif importlib.util.find_spec("torch") is None:
            missing[anchor] = "needs torch, which is not installed"
        elif importlib.util.find_spec(module.partition(".")[0]) is None:
            missing[anchor] = f"{module.partition('.')[0]} is not installed"
    return missing


def run(bench: Bench) -> Iterator[Figure]:
    absent = [package for package in ("numpy", "safetensors") if importlib.util.find_spec(package) is None]
    if absent:
        yield skipped(FIGURE, "cuctx load of a bf16 checkpoint, warm, vs safetensors", "GB/s",
                      ANCHORS["safetensors"][1], f"needs {' and '.join(absent)} (writing and loading the file)",
                      target=">= 3")
        return
    model = FULL_MODEL if bench.backend == "cuda" and not bench.settings.quick else QUICK_MODEL
    repeats = 1 if bench.settings.quick else REPEATS
    digest = "digest" in inspect.signature(load_safetensors).parameters
    missing = _anchor_unavailable(bench)
    anchors = [anchor for anchor in ANCHORS if anchor not in missing]
    with tempfile.TemporaryDirectory(prefix="cuctxd-ckpt-", dir="/tmp") as directory:
        path = os.path.join(directory, "model.safetensors")
        size = write_checkpoint(path, model)
        amount = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
        what = f"cuctx load of a {amount} bf16 checkpoint ({len(model.tensors())} tensors)"
        read_through(path)
        warm = _measure(bench, path, [OURS, *([OURS_NO_DIGEST] if digest else []), *anchors], repeats, lambda: None)
        warm.unavailable.update(missing)
        yield from _warm_figures(bench, what, size, warm, repeats)
        yield _digest_figure(what, size, warm, repeats, digest)
        evict(path)
        left = resident_fraction(path)
        if left > COLD_RESIDENT:
            why = (f"eviction did not take: {left:.0%} of the file stayed in the page cache after fsync + "
                   f"POSIX_FADV_DONTNEED (a tmpfs?)")
            yield skipped(FIGURE, f"{what}, cold, vs the same load warm", "GB/s", "the same load, warm", why)
            yield skipped(FIGURE, f"{what}, cold, vs the fastest other loader", "GB/s", "the fastest other loader, "
                          "cold", why, target=">= 1.2")
            return
        resident: list[float] = []

        def make_cold() -> None:
            evict(path)
            resident.append(resident_fraction(path))

        cold = _measure(bench, path, [OURS, *(anchor for anchor in anchors if anchor in warm.seconds)], repeats,
                        make_cold)
        cold.unavailable = warm.unavailable | cold.unavailable  # an anchor that failed warm is not tried cold
        yield from _cold_figures(bench, what, size, warm, cold, repeats, max(resident))


def _versus(bench: Bench, name: str, ours: float, anchor: str, loads: Loads, size: int, state: str, repeats: int,
            target: str | None = None) -> Figure:
    label = f"{ANCHORS[anchor][1]}, fresh process, {state}"
    theirs = loads.gbps(anchor, size)
    if theirs is None:
        return skipped(FIGURE, name, "GB/s", label, f"{loads.unavailable[anchor]} (cuctx load: {ours:.2f} GB/s "
                       f"{state} on {bench.backend})", target=target)
    return measured(FIGURE, name, ours, "GB/s", label, theirs, target=target,
                    note=f"median of {repeats} loads, each in a fresh process")


def _warm_figures(bench: Bench, what: str, size: int, warm: Loads, repeats: int) -> Iterator[Figure]:
    ours = warm.gbps(OURS, size)
    assert ours is not None
    for anchor in ANCHORS:
        yield _versus(bench, f"{what}, warm, vs {anchor}", ours, anchor, warm, size, "warm", repeats,
                      target=">= 3" if anchor == "safetensors" else None)


def _digest_figure(what: str, size: int, warm: Loads, repeats: int, digest: bool) -> Figure:
    name = f"{what} with content digests, warm: seconds with / without"
    anchor_name = "the same load with digest=False, warm (ratio = with / without: lower is better)"
    if not digest:
        return skipped(FIGURE, name, "s", anchor_name, "load_safetensors takes no digest= keyword here: "
                       "nothing to compare", target="<= 1.10")
    with_digest, without = median(warm.seconds[OURS]), median(warm.seconds[OURS_NO_DIGEST])
    return measured(FIGURE, name, with_digest, "s", anchor_name, without, target="<= 1.10",
                    note=f"median of {repeats} loads, each in a fresh process; {size / with_digest / 1e9:.2f} "
                         f"GB/s with digests, {size / without / 1e9:.2f} GB/s without")


def _cold_figures(bench: Bench, what: str, size: int, warm: Loads, cold: Loads, repeats: int,
                  resident: float) -> Iterator[Figure]:
    ours, ours_warm = cold.gbps(OURS, size), warm.gbps(OURS, size)
    assert ours is not None and ours_warm is not None
    eviction = (f"before each cold load at most {resident:.1%} of the file was in the page cache (mincore, after "
                "fsync + POSIX_FADV_DONTNEED)")
    yield measured(FIGURE, f"{what}, cold, vs the same load warm", ours, "GB/s", "the same load, warm", ours_warm,
                   note=f"median of {repeats} loads, each in a fresh process; {eviction}")
    name = f"{what}, cold, vs the fastest other loader"
    rates = {anchor: rate for anchor in ANCHORS if (rate := cold.gbps(anchor, size)) is not None}
    if not rates:
        yield skipped(FIGURE, name, "GB/s", "the fastest other loader, cold", f"no other loader ran (cuctx load: "
                      f"{ours:.2f} GB/s cold on {bench.backend})", target=">= 1.2")
    else:
        best = max(rates, key=rates.__getitem__)
        yield measured(FIGURE, name, ours, "GB/s", f"the fastest other loader of this run, cold: {ANCHORS[best][1]}",
                       rates[best], target=">= 1.2",
                       note=f"median of {repeats} loads, each in a fresh process; {eviction}")
    for anchor in ANCHORS:
        yield _versus(bench, f"{what}, cold, vs {anchor}", ours, anchor, cold, size, "cold", repeats)
