"""Figure 9: tensors by name — opening a published layout, its GPU memory with consumers.

* Opening a layout of :data:`COUNT` tensors (16 MiB each on cuda: 16 GiB; 64 KiB on sim) in a fresh
  process, from the call to a usable array for every tensor (``torch_weights.load_state_dict`` on the
  GPU, ``open_tensors`` and ``numpy.asarray`` on the sim), its start and connection not counted.
  Anchor (cuda): the same number and sizes of allocations opened one legacy ``cuIpcOpenMemHandle``
  each, timed the same way. The layout's buffer is ``shareable``, so VMM memory where the device has it
  (``cuMemImportFromShareableHandle`` + ``cuMemMap`` of 16 GiB in the consumer); a second figure opens the
  same layout in a legacy buffer (``cuMemAlloc``, one ``cuIpcOpenMemHandle``), against the VMM one: the
  cost of the memory a restart keeps.
* GPU memory (``cuMemGetInfo``) while :data:`CONSUMERS` processes hold that layout as torch tensors,
  against the layout's bytes plus :data:`CONSUMERS` times what one process's CUDA context takes
  (measured here by a process that starts torch and connects, without opening the layout).

Loading a checkpoint from disk is :mod:`bench.figures.checkpoint_load`.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.cuda_local import LocalCuda, LocalDriverUnavailable, _check
from bench.records import Figure, measured, skipped
from bench.run import Bench
from cuctxd.client.tensors.publishing import plan_layout, publish_tensors
from cuctxd.client.wire import build

FIGURE = 9
TITLE = "tensors by name"
COUNT = 1000
CONSUMERS = 4
_LAYOUT = "bench-layout"

_START = """
import sys, time
from cuctxd import Client
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.client.tensors.torch_weights import load_state_dict
backend = sys.argv[2]
if backend == "cuda":
    import torch
    torch.zeros(1, device="cuda")  # the process's own CUDA start is not what is measured
else:
    import numpy
"""

_OPEN = _START + """
with Client(sys.argv[1]) as c:
    c.ping()
    start = time.perf_counter()
    if backend == "cuda":
        with load_state_dict(c, "bench-layout") as loaded:
            arrays = list(loaded.state_dict.values())
            took = time.perf_counter() - start
            assert arrays[-1].is_cuda and len(arrays) == len(loaded.tensors)
            del arrays
    else:
        with open_tensors(c, "bench-layout") as ts:
            arrays = [numpy.asarray(t) for t in ts.values()]
            took = time.perf_counter() - start
            del arrays
print(took * 1e3, flush=True)
"""

#: Holds the layout as torch tensors (or holds nothing, with ``bare``) until a line arrives on stdin.
_HOLD = _START + """
with Client(sys.argv[1]) as c:
    if sys.argv[3] == "bare":
        print("ready", flush=True)
        sys.stdin.readline()
    else:
        with load_state_dict(c, "bench-layout") as loaded:
            arrays = list(loaded.state_dict.values())
            checksum = float(sum(a[:1].float().sum() for a in arrays[:8]))  # the memory is really used
            print("ready", checksum, flush=True)
            sys.stdin.readline()
            del arrays
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
    size = (16 << 20) if cuda else (64 << 10)
    name = f"open_tensors of {COUNT} tensors ({COUNT * size >> 20} MiB) to usable arrays, fresh process"
    local: LocalCuda | None = None
    reason = ""
    try:
        local = bench.local_cuda()
    except LocalDriverUnavailable as unavailable:
        reason = str(unavailable)
    with bench.client() as client:
        used_before = _used(local) if local else 0
        host = memoryview(bytearray(size))
        tensors = {f"layer{i}.weight": host for i in range(COUNT)}
        descriptor = publish_tensors(client, _LAYOUT, tensors)
        try:
            times = [_child(_OPEN, [bench.endpoint(), bench.backend]) for _ in range(3)]
            ours = sorted(times)[1]
            yield _legacy_layout(bench, client, name, descriptor.mechanism, ours, tensors)
            if local is None:
                yield skipped(FIGURE, name, "ms", "the same tensors opened one legacy IPC handle each",
                              f"{reason} ({ours:.1f} ms measured on {bench.backend})")
            else:
                anchor = _legacy_anchor(local, size)
                yield measured(FIGURE, name, ours, "ms", f"the same {COUNT} allocations opened one "
                               "cuIpcOpenMemHandle each, fresh process", anchor, target=None,
                               note=f"median of 3 fresh processes; the issue's bound is < 50 ms absolute: "
                                    f"{ours:.1f} ms")
            yield _consumer_memory(bench, local, reason, used_before, descriptor.size)
        finally:
            client.unpublish(_LAYOUT)


def _legacy_layout(bench: Bench, client: Any, name: str, mechanism: str, ours: float,
                   tensors: dict[str, memoryview]) -> Figure:
    """The same layout in a buffer allocated without ``shareable`` (legacy ``cuMemAlloc`` memory, which a restart
    of the daemon does not keep), opened the same way, against the default one (``mechanism``)."""
    manifest, _, size = plan_layout(tensors)
    buffer = client.alloc(size)  # not shareable: legacy memory, shared by one IPC handle; contents irrelevant here
    try:
        client.run(build.publish(buffer, _LAYOUT + "-legacy", manifest.pack(), False, False))
        legacy_open = _OPEN.replace('"bench-layout"', '"bench-layout-legacy"')
        legacy = sorted(_child(legacy_open, [bench.endpoint(), bench.backend]) for _ in range(3))[1]
    finally:
        buffer.free()  # unpublishes it too
    return measured(FIGURE, f"{name}, legacy cuMemAlloc layout", legacy, "ms",
                    f"the same layout as a {mechanism} share (the default; VMM is what a restart keeps)", ours,
                    target=None, note="median of 3 fresh processes")


def _used(local: LocalCuda) -> int:
    """GPU memory in use (``cuMemGetInfo``), once two readings 0.1 s apart agree: a context torn down is
    given back a little after its process exits."""
    used = -1
    for _ in range(50):
        free, total = _check(local.cu.cuMemGetInfo())
        now = int(total) - int(free)
        if now == used:
            break
        used = now
        time.sleep(0.1)
    return used


def _holders(bench: Bench, how: str, count: int) -> list[subprocess.Popen[str]]:
    processes = [subprocess.Popen([sys.executable, "-c", _HOLD, bench.endpoint(), bench.backend, how],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    for process in processes:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"a consumer process did not start (exit {process.wait()})")
    return processes


def _release(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("\n")
        process.stdin.flush()
    for process in processes:
        if process.wait(timeout=60) != 0:
            raise RuntimeError(f"a consumer process failed (exit {process.returncode})")


def _consumer_memory(bench: Bench, local: LocalCuda | None, reason: str, used_before: int, layout: int) -> Figure:
    name = f"GPU memory with {CONSUMERS} processes holding the layout as torch tensors"
    anchor_name = f"the layout's bytes + {CONSUMERS} bare CUDA contexts"
    if local is None:
        return skipped(FIGURE, name, "MiB", anchor_name, reason)
    with_layout = _used(local)
    bare = _holders(bench, "bare", 1)
    context = _used(local) - with_layout
    _release(bare)
    holders = _holders(bench, "open", CONSUMERS)
    try:
        held = _used(local)
    finally:
        _release(holders)
    value = (held - used_before) / (1 << 20)
    anchor = (layout + CONSUMERS * context) / (1 << 20)
    return measured(FIGURE, name, value, "MiB", anchor_name, anchor, target="<= 1.05",
                    note=f"cuMemGetInfo, from before the publish; one context {context >> 20} MiB; the layout "
                         f"{layout >> 20} MiB; private copies would add {CONSUMERS * layout >> 20} MiB")


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
