"""The processes of figure 10 (:mod:`bench.figures.weight_sync`): a trainer and its engines, each spawned.

Each role answers the parent's commands on its pipe: ``("setup",)`` makes its weights (the trainer's state dict;
an engine's own parameters where its way copies), ``("await", after)`` readies an engine for the next version
(it answers at once, then waits and answers again with the ``time.perf_counter()`` at which it computed with
the new version), ``("publish", marker)`` has the trainer write ``marker`` (a small integer, exact in bf16) into
every tensor (its training step, not timed) and then hand the new weights over (timed from its call on; it
answers that start time),
``("release",)`` lets an engine drop what it no longer needs, ``("stop",)`` ends it. ``perf_counter`` is
CLOCK_MONOTONIC on Linux, one clock for every process.

Where the seconds go: the trainer answers ``("published", started, ended, stages)`` and an engine ``("computed",
at, seen, woken, stages)``, ``stages`` the seconds of each step of the round in that process
(:data:`STAGES` says what each covers), ``ended`` when the trainer's hand-over returned and ``woken`` when the
engine learnt of the new version. They are ``time.perf_counter`` spans around calls the round makes anyway,
no synchronization added: a span covers GPU work only where its call synchronizes.

The ways: ``"zero-copy"`` (engines compute on the version they hold, refreshed), ``"copy"`` (engines copy each
version into parameters of their own, then close it), and the anchors, cuda and torch only: ``"per-tensor"``
(one CUDA IPC handle per tensor, ``torch.multiprocessing.reductions.reduce_tensor``, rebuilt in each engine and
copied into its parameters) and ``"buckets"`` (the tensors flattened into 1 GiB buckets sent as one handle
each, copied out the same way). The trainer talks to the engines directly on pipes of their own in the
anchors' ways, as those systems do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

NAME = "bench-weights"
BUCKET_BYTES = 1 << 30
#: What each stage's span covers. None times GPU work left running: each span's GPU work (copies) is
#: synchronized inside it by the call itself, the others are host work and requests.
STAGES = {
    "trainer alloc": "the alloc request (version_of): the name's spare, or a new VMM allocation while warming up",
    "trainer export": "the export request, only where the trainer has not mapped the buffer yet (warm-up)",
    "trainer open_shared": "importing and mapping the buffer in the trainer, only where not mapped yet (warm-up)",
    "trainer host writes": "the host tensors written through the data plane (the sim only)",
    "trainer publish request": "the publish request: the version made current, waiting engines answered",
    "trainer rest": "planning the layout, the device-to-device copies and their synchronize (the mapping is kept)",
    "trainer total": "publish_version's call, whole",
    "trainer reduce_tensor": "one CUDA IPC handle per tensor (per-tensor)",
    "trainer fill buckets": "copies into the buckets, synchronized, and one handle each (buckets)",
    "trainer send": "the handles pickled and sent to every engine",
    "engine refresh": "lookup of the newest version, its hold, import and map (none where its buffer is mapped "
                      "already), its TensorSet",
    "engine views": "LoadedState over the new share: one torch tensor per tensor, or the views made for that "
                    "buffer before (torch only)",
    "engine open": "open of the newest version: lookup, import, map and its views",
    "engine copy_into": "the version copied into the engine's parameters (synchronized on cuda)",
    "engine close": "the version unmapped and let go",
    "engine rebuild and copy": "the IPC handles opened and copied from, synchronized",
    "engine first compute": "reading the marker back (.item(): synchronizes)",
}


def shapes(total: int, count: int) -> list[int]:
    """Elements (bf16, 2 bytes) of each of ``count`` tensors of ``total`` bytes together."""
    each = total // count // 2
    return [each] * count


def run_trainer(endpoint: str, backend: str, way: str, total: int, count: int, parent: Connection,
                engines: list[Connection]) -> None:
    """The trainer's process (module docstring)."""
    from cuctxd import Client
    from cuctxd.client.tensors.versions import publish_version

    torch = _start(backend)
    params: dict[str, Any] = {}
    buckets: list[Any] = []
    with Client(endpoint, timeout=600) as client:
        for command in _commands(parent):
            if command[0] == "setup":
                params = {f"layers.{i}.weight": _tensor(torch, n) for i, n in enumerate(shapes(total, count))}
                if way == "buckets":
                    buckets = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in _bucket_sizes(params)]
                parent.send(("ready",))
                continue
            marker = command[1]
            for tensor in params.values():
                tensor[0] = marker
            if torch is not None:
                torch.cuda.synchronize()
            started = time.perf_counter()
            stages: dict[str, float] = {}
            if way in ("zero-copy", "copy"):
                timed = _Timed(client)
                publish_version(timed, NAME, params)
                stages = timed.stages(time.perf_counter() - started)
            else:
                if way == "per-tensor":
                    from torch.multiprocessing.reductions import reduce_tensor

                    sent: Any = [(key, reduce_tensor(tensor)) for key, tensor in params.items()]
                    stages["trainer reduce_tensor"] = time.perf_counter() - started
                else:
                    sent = _fill_buckets(torch, params, buckets)
                    stages["trainer fill buckets"] = time.perf_counter() - started
                for engine in engines:
                    engine.send(sent)
                stages["trainer send"] = time.perf_counter() - started - sum(stages.values())
            parent.send(("published", started, time.perf_counter(), stages))


class _Timed:
    """The trainer's client as ``publish_version`` uses it, each method call's seconds noted in order (how the
    figure sees its stages without touching the library). Which thread: the trainer's only."""

    #: The client's methods timed (its requests): any other attribute is the client's own, untouched.
    TIMED = frozenset({"alloc", "export", "open_shared", "run"})

    def __init__(self, client: Any) -> None:
        self._client = client
        self._calls: list[tuple[str, float]] = []
        self._depth = 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._client, name)
        if name not in self.TIMED:
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            began = time.perf_counter()
            try:
                return found(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:  # a call made within another is in that one's seconds
                    self._calls.append((name, time.perf_counter() - began))

        return timed

    def stages(self, total: float) -> dict[str, float]:
        """The calls' seconds by stage (:data:`STAGES`): the first ``run`` is the alloc request (``version_of``),
        the last the publish request, any between them the host writes; what no call covers is ``trainer rest``."""
        stages: dict[str, float] = {}
        runs = [index for index, (name, _) in enumerate(self._calls) if name == "run"]
        for index, (name, seconds) in enumerate(self._calls):
            stage = ("trainer alloc" if index == runs[0] else "trainer publish request" if index == runs[-1]
                     else "trainer host writes" if name == "run" else f"trainer {name}")
            stages[stage] = stages.get(stage, 0.0) + seconds
        stages["trainer rest"] = total - sum(stages.values())
        stages["trainer total"] = total
        return stages


def _fill_buckets(torch: Any, params: dict[str, Any], buckets: list[Any]) -> list[tuple[Any, list[Any]]]:
    """The tensors flattened into the buckets (each tensor whole in one), and each bucket's handle with where
    each of its tensors lies."""
    from torch.multiprocessing.reductions import reduce_tensor

    placed: list[list[tuple[str, int, int]]] = [[] for _ in buckets]
    index, at = 0, 0
    for key, tensor in params.items():
        nbytes = tensor.numel() * tensor.element_size()
        if at + nbytes > buckets[index].numel():
            index, at = index + 1, 0
        buckets[index][at:at + nbytes].copy_(tensor.view(-1).view(torch.uint8))
        placed[index].append((key, at, nbytes))
        at += nbytes
    torch.cuda.synchronize()
    return [(reduce_tensor(bucket), where) for bucket, where in zip(buckets, placed, strict=True)]


def _bucket_sizes(params: dict[str, Any]) -> list[int]:
    sizes, at = [], 0
    for tensor in params.values():
        nbytes = tensor.numel() * tensor.element_size()
        if at + nbytes > BUCKET_BYTES:
            sizes.append(at)
            at = 0
        at += nbytes
    return [*sizes, at]


def run_engine(endpoint: str, backend: str, way: str, total: int, count: int, parent: Connection,
               trainer: Connection | None) -> None:
    """An engine's process (module docstring)."""
    from cuctxd import Client
    from cuctxd.client.tensors.tensor_sets import open_tensors
    from cuctxd.client.tensors.torch_weights import load_state_dict
    from cuctxd.client.tensors.versions import wait_version

    torch = _start(backend)
    own: dict[str, Any] = {}
    held: Any = None  # zero-copy: the version it computes with
    previous: Any = None  # zero-copy: the one before, until the parent says it may go
    last = f"layers.{count - 1}.weight"
    with Client(endpoint, timeout=600) as client:
        for command in _commands(parent):
            if command[0] == "setup":
                if way != "zero-copy":
                    own = {f"layers.{i}.weight": _tensor(torch, n) for i, n in enumerate(shapes(total, count))}
                if way in ("zero-copy", "copy"):
                    held = load_state_dict(client, NAME) if torch is not None else open_tensors(client, NAME)
                    if way == "copy":
                        held.close()
                        held = None
                parent.send(("ready",))
            elif command[0] == "release":
                if previous is not None:
                    previous.close()
                    previous = None
                parent.send(("released",))
            else:
                parent.send(("waiting",))
                after = command[1]
                spans = _Spans()
                if way == "zero-copy":
                    wait_version(client, NAME, after)
                    woken = spans.mark()
                    newer = held.tensors.refresh() if torch is not None else held.refresh()  # LoadedState.refresh
                    spans.end("engine refresh")
                    previous, held = held, held.successor(newer) if torch is not None else newer
                    spans.end("engine views")
                    seen = _first(torch, held.state_dict[last] if torch is not None else held[last])
                elif way == "copy":
                    wait_version(client, NAME, after)
                    woken = spans.mark()
                    got = load_state_dict(client, NAME) if torch is not None else open_tensors(client, NAME)
                    spans.end("engine open")
                    with got:
                        got.copy_into(own)
                        spans.end("engine copy_into")
                    spans.end("engine close")
                    seen = _first(torch, own[last])
                else:
                    assert trainer is not None
                    sent = trainer.recv()
                    woken = spans.mark()
                    _copy_handles(torch, sent, own, way)
                    spans.end("engine rebuild and copy")
                    seen = _first(torch, own[last])
                spans.end("engine first compute")
                parent.send(("computed", spans.at, seen, woken, spans.stages))


class _Spans:
    """Consecutive ``perf_counter`` spans of an engine's round, each named as it ends (:data:`STAGES`)."""

    def __init__(self) -> None:
        self.at = time.perf_counter()
        self.stages: dict[str, float] = {}

    def mark(self) -> float:
        """Start the next span now and return the time."""
        self.at = time.perf_counter()
        return self.at

    def end(self, stage: str) -> None:
        """End the span begun at the last mark or end as ``stage``."""
        now = time.perf_counter()
        self.stages[stage] = now - self.at
        self.at = now


def _commands(parent: Connection) -> Iterator[tuple[Any, ...]]:
    """The parent's commands until ``("stop",)``, once this process said it is up."""
    parent.send(("up",))
    while (command := parent.recv())[0] != "stop":
        yield command


def _copy_handles(torch: Any, sent: Any, own: dict[str, Any], way: str) -> None:
    """Rebuild the trainer's tensors (or buckets) from their CUDA IPC handles and copy them into ``own``; the
    rebuilt ones are let go (their handles closed) only once every copy is done."""
    rebuilt = []
    if way == "per-tensor":
        for key, (rebuild, args) in sent:
            rebuilt.append(rebuild(*args))
            own[key].copy_(rebuilt[-1], non_blocking=True)
    else:
        for (rebuild, args), where in sent:
            rebuilt.append(bucket := rebuild(*args))
            for key, at, nbytes in where:
                own[key].view(-1).view(torch.uint8).copy_(bucket[at:at + nbytes], non_blocking=True)
    torch.cuda.synchronize()
    rebuilt.clear()


def _start(backend: str) -> Any:
    """torch with its CUDA context made (cuda), so no figure counts a process's start; None on the sim."""
    if backend != "cuda":
        return None
    import torch

    torch.zeros(1, device="cuda")
    return torch


def _tensor(torch: Any, elements: int) -> Any:
    """One bf16 tensor on the GPU (torch), or a uint16 one of the same bytes in host memory (the sim)."""
    if torch is not None:
        return torch.zeros(elements, dtype=torch.bfloat16, device="cuda")
    import numpy

    return numpy.zeros(elements, dtype=numpy.uint16)


def _first(torch: Any, tensor: Any) -> float:
    """The tensor's first element, read back: a computation with what the engine holds now."""
    if torch is not None:
        return float(tensor[:1].float().sum().item())
    import numpy

    return float(numpy.asarray(tensor)[0])
