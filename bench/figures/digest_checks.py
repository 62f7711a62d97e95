"""Figure 11: verify a layout's digest on the device — what the daemon's first check of another user's digest
costs (``verify_shared``, PROTOCOL.md section 9, "Digests").

A layout of :data:`TENSORS` tensors (2.5 GiB on cuda, 256 MiB on sim, 32 MiB with ``--quick``) is published
:data:`REPEATS` times under names of their own, each relied on once from a tcp:// session (a peer of no known
uid, so never the publisher's user): each reliance copies the layout to the host in chunks and hashes it on
the daemon's helper threads. Reported: the median seconds of ``verify_shared`` (the request's round trip), and
the same as GB/s. Anchor, measured in this run: the client's own hash of the same bytes from host memory
(:func:`cuctxd.client.tensors.hashing.hash_views`, the threads a client's load uses), which the check adds a
device-to-host copy to. Own-uid reliances are not hashed at all (``verified: "publisher"``): not measured here.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import numpy as np

from bench.records import Figure, measured
from bench.run import Bench
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.protos.errors import NotFound
from cuctxd.protos.layouts import check_manifest

FIGURE = 11
TITLE = "digest checks on the device"
TENSORS = 10
REPEATS = 3
_NAME = "bench-verify"


def run(bench: Bench) -> Iterator[Figure]:
    size = (32 << 20) if bench.settings.quick else (2560 << 20) if bench.backend == "cuda" else (256 << 20)
    repeats = 1 if bench.settings.quick else REPEATS
    data = np.random.default_rng(10).integers(0, 256, size, dtype=np.uint8)
    tensors = {f"layer{i}.weight": part for i, part in enumerate(np.array_split(data, TENSORS))}
    views = [memoryview(part) for part in tensors.values()]
    hashing = []
    for _ in range(repeats):
        started = time.perf_counter()
        hash_views(views)
        hashing.append(time.perf_counter() - started)
    anchor = statistics.median(hashing)
    names = [f"{_NAME}-{i}" for i in range(repeats)]
    seconds: list[float] = []
    with bench.client() as publisher, bench.client("tcp") as relier:
        try:
            for name in names:
                descriptor = publish_tensors(publisher, name, tensors)
                digest = check_manifest(descriptor.manifest, descriptor.size).digest
                assert digest is not None
                started = time.perf_counter()
                answer = relier.verify_shared(name, digest, descriptor.device)
                seconds.append(time.perf_counter() - started)
                if not answer["hashed"]:
                    raise RuntimeError(f"verify_shared of {name!r} did not hash it: {answer}")
        finally:
            for name in names:
                with contextlib.suppress(NotFound):  # not published, after a failure: nothing to undo
                    publisher.unpublish(name)
    ours = statistics.median(seconds)
    amount = f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"
    what = f"verify a layout's digest on the device ({amount}, {TENSORS} tensors), first reliance by another uid"
    note = f"median of {repeats} checks, each of a layout published anew"
    yield measured(FIGURE, f"{what}: seconds", ours, "s", "the client's hash of the same bytes in host memory "
                   "(ratio = check / host hash)", anchor, note=note)
    yield measured(FIGURE, f"{what}: GB/s", size / ours / 1e9, "GB/s", "the client's hash of the same bytes in "
                   "host memory", size / anchor / 1e9, note=note)
