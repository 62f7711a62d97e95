"""How much to measure: the full run, and the ``--quick`` smoke run (under a minute)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    quick: bool
    ping_samples: int          # round trips per latency figure (after warmup)
    warmup: int
    throughput_seconds: float  # per round of a throughput point
    throughput_rounds: int     # rounds per point, daemon and anchor alternating
    client_counts: tuple[int, ...]
    alloc_pairs: int
    bandwidth_reps: dict[int, int]  # transfer size -> repetitions
    ipc_copy_reps: int
    isolation_samples: int
    isolation_seconds: float   # cap on the loaded phase of a head-of-line figure
    sim_copy_size: int         # bytes per device-to-device copy in the load (sim backend)
    cuda_copy_size: int        # the same on the cuda backend
    copies_per_sync: int
    pipeline_writes: int
    pipeline_repeats: int


MiB = 1 << 20

FULL = Settings(
    quick=False, ping_samples=20_000, warmup=2_000, throughput_seconds=1.0, throughput_rounds=3,
    client_counts=(1, 4, 8),
    alloc_pairs=2_000, bandwidth_reps={64 << 10: 1_000, MiB: 200, 64 * MiB: 20}, ipc_copy_reps=20,
    isolation_samples=3_000, isolation_seconds=20.0, sim_copy_size=256 * MiB, cuda_copy_size=1024 * MiB,
    copies_per_sync=32, pipeline_writes=1_000, pipeline_repeats=10,
)

QUICK = Settings(
    quick=True, ping_samples=2_000, warmup=300, throughput_seconds=0.5, throughput_rounds=1,
    client_counts=(1, 4, 8),
    alloc_pairs=200, bandwidth_reps={64 << 10: 100, MiB: 20, 64 * MiB: 3}, ipc_copy_reps=5,
    isolation_samples=300, isolation_seconds=3.0, sim_copy_size=64 * MiB, cuda_copy_size=1024 * MiB,
    copies_per_sync=16, pipeline_writes=1_000, pipeline_repeats=3,
)
