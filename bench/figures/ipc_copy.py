"""Figure 5: copies in this process on a daemon-owned buffer opened over CUDA IPC (cuda only).

A buffer allocated with ``shareable=True`` is exported by the daemon and mapped
here with ``Client.open_shared``; the bench then times ``cuMemcpyDtoD`` (into the
opened pointer, from a local buffer) and pageable ``cuMemcpyHtoD`` on it,
against the same copies into a ``cuMemAlloc`` buffer of this process.
"""

from __future__ import annotations

from collections.abc import Iterator

from bench.anchors import pattern
from bench.cuda_local import LocalDriverUnavailable
from bench.records import Figure, measured, skipped
from bench.run import Bench, alloc_shareable
from bench.stats import gbps, interleaved, median

FIGURE = 5
TITLE = "IPC-opened copy bandwidth"
SIZE = 64 << 20
DTOD_PER_SAMPLE = 10


def run(bench: Bench) -> Iterator[Figure]:
    names = ("DtoD 64 MiB into an IPC-opened daemon buffer", "HtoD 64 MiB into an IPC-opened daemon buffer")
    anchors = ("the same cuMemcpyDtoD into an in-process cuMemAlloc buffer",
               "the same pageable cuMemcpyHtoD into an in-process cuMemAlloc buffer")
    try:
        local = bench.local_cuda()
    except LocalDriverUnavailable as unavailable:
        for name, anchor in zip(names, anchors, strict=True):
            yield skipped(FIGURE, name, "GB/s", anchor, f"{unavailable} (CUDA IPC maps device memory)")
        return
    host = pattern(SIZE)
    with bench.client() as client:
        shared = alloc_shareable(client, SIZE, device=0)
        with client.open_shared(shared.export()) as opened:
            opened_ptr = opened.ptr
            src, dst = local.alloc(SIZE), local.alloc(SIZE)
            try:
                local.htod(src, host, SIZE)

                def dtod(into: int) -> None:
                    for _ in range(DTOD_PER_SAMPLE):
                        local.dtod(into, src, SIZE)
                    local.synchronize()

                samples = interleaved({
                    "ipc_dtod": lambda: dtod(opened_ptr), "local_dtod": lambda: dtod(dst),
                    "ipc_htod": lambda: local.htod(opened_ptr, host, SIZE),
                    "local_htod": lambda: local.htod(dst, host, SIZE),
                }, bench.settings.ipc_copy_reps, warmup=2, blocks=min(bench.settings.ipc_copy_reps, 5))
            finally:
                local.free(src)
                local.free(dst)
        if shared.read(4096) != host[:4096]:
            raise AssertionError("the daemon's buffer does not hold what was copied into its IPC mapping")
        shared.free()
    note = f"median of {bench.settings.ipc_copy_reps} samples"
    yield measured(FIGURE, names[0], gbps(SIZE * DTOD_PER_SAMPLE, median(samples["ipc_dtod"])), "GB/s", anchors[0],
                   gbps(SIZE * DTOD_PER_SAMPLE, median(samples["local_dtod"])),
                   note=f"{note}; {DTOD_PER_SAMPLE} copies + cuCtxSynchronize per sample")
    yield measured(FIGURE, names[1], gbps(SIZE, median(samples["ipc_htod"])), "GB/s", anchors[1],
                   gbps(SIZE, median(samples["local_htod"])), note=note)
