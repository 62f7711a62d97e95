"""Digests of many host views at once, on threads: what a layout's bytes are (:mod:`cuctxd.protos.digests`).

Used where the bytes are in this process already: :func:`~cuctxd.client.tensors.publishing.publish_tensors`'s
host tensors (hashed while they are copied) and a checkpoint's files mapped to compare with a published
layout (:mod:`cuctxd.client.tensors.checkpoints`). A large view's leaves are split among the threads, small
views go in groups; xxhash releases the GIL while it hashes. Which thread may call: any.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cuctxd.protos import digests

#: Bytes one hashing task covers at most (whole leaves), so a large tensor is hashed by many threads at once.
TASK_BYTES = 16 * digests.LEAF_BYTES
#: Most threads hashing at once.
MAX_THREADS = 16

_Span = tuple[int, int, int]  # (view index, first byte, end byte)


def _tasks(views: Sequence[memoryview]) -> list[list[_Span]]:
    tasks: list[list[_Span]] = [[]]
    load = 0
    for index, view in enumerate(views):
        for start in range(0, max(view.nbytes, 1), TASK_BYTES):
            stop = min(start + TASK_BYTES, view.nbytes)
            if load >= TASK_BYTES:
                tasks.append([])
                load = 0
            tasks[-1].append((index, start, stop))
            load += stop - start + 4096  # a tiny tensor still costs a call
    return tasks


def hash_views(views: Sequence[memoryview], threads: int | None = None) -> list[str]:
    """Each view's digest (:func:`cuctxd.protos.digests.tensor_digest` of its bytes), in order; views must be
    C-contiguous and must not change meanwhile."""
    flat = [memoryview(view).cast("B") for view in views]

    def run(task: list[_Span]) -> list[tuple[int, int, list[bytes]]]:
        return [(index, start, [digests.leaf(flat[index][at:min(at + digests.LEAF_BYTES, stop)])
                                for at in range(start, stop, digests.LEAF_BYTES)])
                for index, start, stop in task]

    pieces: list[dict[int, list[bytes]]] = [{} for _ in flat]
    workers = threads or min(MAX_THREADS, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cuctxd-hash") as pool:
        for part in pool.map(run, _tasks(flat)):
            for index, start, leaves in part:
                pieces[index][start] = leaves
    return [digests.from_leaves(leaf for start in sorted(spans) for leaf in spans[start]) for spans in pieces]


__all__ = ["hash_views"]
