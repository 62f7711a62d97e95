"""The figures, one module per group; each has ``FIGURE`` (its number), ``TITLE`` and ``run(bench)``.

``run`` yields :class:`~bench.records.Figure` records as it measures them, so a
group that breaks half way keeps what it already measured.
"""

from __future__ import annotations

from types import ModuleType

from bench.figures import (
    alloc,
    bandwidth,
    checkpoint_load,
    data_plane,
    digest_checks,
    ipc_copy,
    isolation,
    latency,
    pipelining,
    tensors,
    throughput,
    weight_sync,
)

GROUPS: tuple[ModuleType, ...] = (latency, throughput, alloc, bandwidth, ipc_copy, isolation, pipelining, data_plane,
                                  tensors, checkpoint_load, weight_sync, digest_checks)
