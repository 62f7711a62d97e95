"""Figure 9: tensors by name — a fresh process maps a published layout of 1,000 tensors.

A layout of :data:`COUNT` tensors (1 MiB each on cuda: 1 GiB; 64 KiB on sim) is
published once; then a fresh process times ``open_tensors`` plus a usable array
for every tensor (``torch.as_tensor`` on the GPU, ``numpy.asarray`` on the sim),
from the call to the last array, its start and connection not counted. The anchor
(cuda): the same number and sizes of allocations opened in a fresh process one
legacy ``cuIpcOpenMemHandle`` each, timed the same way.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import Iterator

from bench.cuda_local import LocalCuda, LocalDriverUnavailable, _check
from bench.records import Figure, measured, skipped
from bench.run import Bench
from cuctxd.client.tensors import publish_tensors

FIGURE = 9
TITLE = "tensors by name"
COUNT = 1000

_OPEN = """
import sys, time
from cuctxd import Client
from cuctxd.client.tensors import open_tensors
backend = sys.argv[2]
if backend == "cuda":
    import torch
    torch.zeros(1, device="cuda")  # the process's own CUDA start is not what is measured
else:
    import numpy
with Client(sys.argv[1]) as c:
    c.ping()
    start = time.perf_counter()
    with open_tensors(c, "bench-layout", writable=True) as ts:  # torch takes only writable CUDA arrays
        if backend == "cuda":
            arrays = [torch.as_tensor(t, device="cuda") for t in ts.values()]
        else:
            arrays = [numpy.asarray(t) for t in ts.values()]
        took = time.perf_counter() - start
        assert len(arrays) == len(ts)
        del arrays
print(took * 1e3, flush=True)
"""

_LEGACY = """
import sys, time, ctypes
from cuda.bindings import driver as cu
cu.cuInit(0)
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxSetCurrent(ctx)
handles = [bytes.fromhex(h) for h in sys.stdin.read().split()]
start = time.perf_counter()
for raw in handles:
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), raw, 64)
    err, ptr = cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    assert err == 0, err
print((time.perf_counter() - start) * 1e3)
"""


def _child(code: str, args: list[str], stdin: str = "") -> float:
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args], input=stdin,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the timing process failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def run(bench: Bench) -> Iterator[Figure]:
    cuda = bench.backend == "cuda"
    size = (1 << 20) if cuda else (64 << 10)
    name = f"open_tensors of {COUNT} tensors ({COUNT * size >> 20} MiB) to usable arrays, fresh process"
    with bench.client() as client:
        host = memoryview(bytearray(size))
        publish_tensors(client, "bench-layout", {f"layer{i}.weight": host for i in range(COUNT)})
        try:
            times = [_child(_OPEN, [bench.endpoint(), bench.backend]) for _ in range(3)]
        finally:
            client.unpublish("bench-layout")
    ours = sorted(times)[1]
    if not cuda:
        yield skipped(FIGURE, name, "ms", "the same tensors opened one legacy IPC handle each",
                      f"legacy IPC handles need the cuda backend ({ours:.1f} ms measured on {bench.backend})")
        return
    try:
        local = bench.local_cuda()
    except LocalDriverUnavailable as unavailable:
        yield skipped(FIGURE, name, "ms", "legacy IPC handles", str(unavailable))
        return
    anchor = _legacy_anchor(local, size)
    yield measured(FIGURE, name, ours, "ms", f"the same {COUNT} allocations opened one cuIpcOpenMemHandle each, "
                   "fresh process", anchor, target=None,
                   note=f"median of 3 fresh processes; the issue's bound is < 50 ms absolute: {ours:.1f} ms")


def _legacy_anchor(local: LocalCuda, size: int) -> float:
    cu = local.cu
    pointers = [local.alloc(size) for _ in range(COUNT)]
    try:
        handles = []
        for ptr in pointers:
            handle = _check(cu.cuIpcGetMemHandle(ptr))
            handles.append(ctypes.string_at(handle.getPtr(), 64).hex())
        return _child(_LEGACY, [], " ".join(handles))
    finally:
        for ptr in pointers:
            local.free(ptr)
