"""Issue 40, item 1, as a body for either backend: whatever stops the daemon, processes that map a share keep
computing with its bytes.

A producer publishes a bf16 model (square matrices of a fixed seed, as a tensor layout, persistent as the client
publishes layouts by default) and exits. Worker processes, each a fresh interpreter (never a fork of a process
that started CUDA: what multiprocessing's ``spawn`` gives too), open it and print the SHA-256 of a deterministic
matmul output of their own (each multiplies every matrix by its own input). The daemon is stopped: SIGTERM,
SIGINT, ``cuctx shutdown``, a drain that times out (a reader that never takes its replies holds it past
``--drain-timeout``, longer than the lease, so sessions that cannot renew theirs must not be reaped meanwhile),
or SIGKILL; plain, or under the test service manager (:mod:`tests.service_manager`, whose fd store keeps parked
shares). Then each worker computes again through the mapping it kept: the outputs must be the same bits.

The cuda backend computes with torch on the GPU (:mod:`tests.gpu.test_mapped_through_stop_gpu`), the sim with
numpy over the shared host bytes (:mod:`tests.reliability.test_mapped_through_stop`). :func:`run_case` returns a
:class:`CaseResult`, whose :meth:`~CaseResult.line` is the one-line summary the tests print.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zmq

from cuctxd import Client
from cuctxd.protos.messages import pack
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.helpers import (
    REPO,
    DaemonProcess,
    client_env,
    cuctx,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    wait_for_line,
    wait_until,
)
from tests.service_manager import ServiceManager

MiB = 1 << 20
#: How the daemon is stopped, and the exit status each stop ends with.
EXIT_STATUS = {"sigterm": 0, "sigint": 0, "shutdown": 0, "drain_timeout": 1, "sigkill": -signal.SIGKILL}
STOPS = tuple(EXIT_STATUS)
#: The drain case's daemon: sessions' leases shorter than the drain, which the reader holds past its deadline.
DRAIN_ARGS = ("--lease-ttl", "2", "--drain-timeout", "4")
#: The reader that holds the drain: reads of this size, never taken.
HELD_READS, HELD_READ_BYTES = 6, 8 * MiB
NAME = "stop-model"


@dataclass(frozen=True)
class Model:
    """``matrices`` bf16 matrices of ``side`` x ``side``; each worker multiplies them by a ``side`` x ``columns``
    input of its own."""

    matrices: int
    side: int
    columns: int

    @property
    def nbytes(self) -> int:
        return 2 * self.matrices * self.side * self.side


@dataclass(frozen=True)
class CaseResult:
    backend: str
    stop: str
    managed: bool
    workers: int
    model_bytes: int
    identical: bool
    exit_status: int
    #: Seconds from the stop asked to the daemon's exit.
    stop_s: float
    #: Seconds of the whole case: daemon start to the workers' last output.
    case_s: float
    log: str

    def line(self) -> str:
        return (f"STOP-CASE backend={self.backend} stop={self.stop} manager={'yes' if self.managed else 'no'} "
                f"workers={self.workers} model_bytes={self.model_bytes} identical={'yes' if self.identical else 'no'} "
                f"exit={self.exit_status} stop_s={self.stop_s:.2f} case_s={self.case_s:.1f}")


_PRODUCER = """
import numpy
from cuctxd import Client
from cuctxd.client.tensors.publishing import publish_tensors
with Client(ENDPOINT, name="stop-producer") as c:
    if c.backend == "cuda":
        import torch
        from cuctxd.client.tensors.torch_weights import publish_state_dict
        g = torch.Generator(device="cuda").manual_seed(40)
        weights = {f"layers.{i}.weight": torch.randn(SIDE, SIDE, generator=g, device="cuda", dtype=torch.bfloat16)
                   for i in range(MATRICES)}
        torch.cuda.synchronize()
        publish_state_dict(c, NAME, weights)
    else:
        rng = numpy.random.default_rng(40)
        tensors = {}
        for i in range(MATRICES):
            bits = rng.standard_normal((SIDE, SIDE), dtype=numpy.float32).view(numpy.uint32) >> 16
            tensors[f"layers.{i}.weight"] = (bits.astype(numpy.uint16).view(numpy.int16), "bfloat16")
        publish_tensors(c, NAME, tensors)
print("published", flush=True)
"""

_WORKER = """
import hashlib, os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy
from cuctxd import Client
if BACKEND == "cuda":
    import torch
    torch.use_deterministic_algorithms(True)
    torch.zeros(1, device="cuda")  # this process's own CUDA start, before it is told to go
print("started", flush=True)
sys.stdin.readline()
c = Client(ENDPOINT, name=f"stop-worker-{INDEX}")
if BACKEND == "cuda":
    from cuctxd.client.tensors.torch_weights import load_state_dict
    loaded = load_state_dict(c, NAME)
    weights = [loaded.state_dict[key] for key in sorted(loaded.state_dict)]
    g = torch.Generator(device="cuda").manual_seed(1000 + INDEX)
    x = torch.randn(SIDE, COLUMNS, generator=g, device="cuda", dtype=torch.bfloat16)
    def output():
        digest = hashlib.sha256()
        for w in weights:
            digest.update((w @ x).cpu().view(torch.int16).numpy().tobytes())
        return digest.hexdigest()
else:
    from cuctxd.client.tensors.tensor_sets import open_tensors
    layout = open_tensors(c, NAME)
    view = layout.share.host_view()
    offsets = [layout[key].spec.offset for key in sorted(layout)]
    x = numpy.random.default_rng(1000 + INDEX).standard_normal((SIDE, COLUMNS), dtype=numpy.float32)
    def output():
        digest = hashlib.sha256()
        for offset in offsets:
            bits = numpy.frombuffer(view, numpy.uint16, SIDE * SIDE, offset).astype(numpy.uint32) << 16
            digest.update((bits.view(numpy.float32).reshape(SIDE, SIDE) @ x).tobytes())
        return digest.hexdigest()
print("before", output(), flush=True)
sys.stdin.readline()
print("after", output(), flush=True)
os._exit(0)  # the daemon may be gone: no goodbye, and the mapping goes with the process
"""


def run_case(backend: str, stop: str, *, managed: bool, model: Model, workers: int,
             ready_timeout: float = 30.0, timeout: float = 60.0) -> CaseResult:
    """One daemon, one producer and ``workers`` workers through one stop (module docstring)."""
    started = time.monotonic()
    workdir = short_tempdir()
    extra = DRAIN_ARGS if stop == "drain_timeout" else ()
    manager = ServiceManager(workdir) if managed else None
    daemon = (manager.start(*extra, backend=backend, ready_timeout=ready_timeout) if manager is not None
              else start_daemon(*extra, backend=backend, ready_timeout=ready_timeout))
    sizes = f"SIDE = {model.side}\nMATRICES = {model.matrices}\nCOLUMNS = {model.columns}\nNAME = {NAME!r}\n"
    running: list[Script] = []
    try:
        running.append(Script(workdir, "producer", sizes + _PRODUCER, daemon.endpoint))
        running += [Script(workdir, f"worker-{index}", f"{sizes}BACKEND = {backend!r}\nINDEX = {index}\n{_WORKER}",
                            daemon.endpoint) for index in range(workers)]
        producer, team = running[0], running[1:]
        producer.line("published", timeout)
        for worker in team:
            worker.line("started", timeout)
            worker.tell()
        before = [worker.line("before", timeout).split()[1] for worker in team]
        asked = time.monotonic()
        status = _stop(daemon, stop, manager)
        stop_s = time.monotonic() - asked
        for worker in team:
            worker.tell()
        after = [worker.line("after", timeout).split()[1] for worker in team]
        assert len(set(before)) == workers, f"each worker's input is its own, so are its outputs: {before}"
        return CaseResult(backend, stop, managed, workers, model.nbytes, before == after, status, stop_s,
                          time.monotonic() - started, daemon.log())
    finally:
        for script in running:
            script.close()
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.stop()
        if manager is not None:
            manager.close()
        remove_tempdir(daemon.socket_dir)
        remove_tempdir(workdir)


def _stop(daemon: DaemonProcess, stop: str, manager: ServiceManager | None) -> int:
    """Stop ``daemon`` as ``stop`` says; its exit status."""
    process = daemon.process
    if stop in ("sigterm", "sigint"):
        process.send_signal(signal.SIGTERM if stop == "sigterm" else signal.SIGINT)
    elif stop == "shutdown":
        done = cuctx("--endpoint", daemon.endpoint, "shutdown", timeout=60)
        assert done.returncode == 0, done.stderr
    elif stop == "drain_timeout":
        with held_replies(daemon.endpoint):
            process.send_signal(signal.SIGTERM)
            return process.wait(60)
    elif stop == "sigkill":
        if manager is not None:
            manager.kill()
        else:
            process.send_signal(signal.SIGKILL)
    else:
        raise ValueError(f"no stop {stop!r}")
    return process.wait(60)


@contextlib.contextmanager
def held_replies(endpoint: str) -> Any:
    """A session whose reads are answered but never taken (one message of room, a small socket buffer), for the
    block: the daemon holds their bytes, so its drain cannot finish before its deadline. Returns once the daemon
    counts at least two replies held."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 64 << 10)
    socket.connect(endpoint)
    try:
        session = _call(socket, {"op": "hello", "args": {"protocol": PROTOCOL_VERSION, "client": "held-replies"}})
        token = session["session"]
        buffer = _call(socket, {"op": "alloc", "session": token, "args": {"size": HELD_READ_BYTES, "device": 0}})
        for index in range(HELD_READS):
            socket.send(pack({"id": 100 + index, "op": "read", "session": token,
                              "args": {"buffer": buffer["buffer"]["handle"], "size": HELD_READ_BYTES, "device": 0}}))
        with Client(endpoint, name="held-replies-watch") as watch:
            assert wait_until(lambda: _reply_bytes(watch, session["session_id"]) >= 2 * HELD_READ_BYTES, 30), \
                "the daemon never held the reader's replies"
        yield
    finally:
        socket.close()


def _call(socket: zmq.Socket[Any], header: dict[str, Any]) -> dict[str, Any]:
    import msgpack

    socket.send(pack({"id": 1, **header}))
    assert socket.poll(10_000), f"no reply to {header['op']}"
    reply = msgpack.unpackb(socket.recv_multipart()[0], raw=False)
    assert reply["ok"], reply
    result: dict[str, Any] = reply["result"]
    return result


def _reply_bytes(client: Client, session_id: int) -> int:
    """Reply bytes the daemon holds for ``session_id`` (``status``'s queues)."""
    return sum(queue["reply_bytes"] for device in client.status()["devices"]
               for queue in device.get("queues", []) if queue["session"] == session_id)


class Script:
    """A Python process running ``code`` (with ``ENDPOINT``): told to go on through its stdin, read through its
    stdout; its stderr in a file of ``workdir``, quoted when it does not say what is awaited."""

    def __init__(self, workdir: Path, name: str, code: str, endpoint: str) -> None:
        self.errors_path = workdir / f"{name}.stderr"
        self._errors: IO[str] = self.errors_path.open("w")
        self.process = subprocess.Popen([sys.executable, "-c", f"ENDPOINT = {endpoint!r}\n{code}"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors,
                                        text=True, env=client_env(), cwd=REPO)
        self.name = name

    def line(self, expected: str, timeout: float) -> str:
        try:
            return wait_for_line(self.process, expected, timeout)
        except AssertionError as failure:
            raise AssertionError(f"{self.name}: {failure}\n{self.errors_path.read_text()[-3000:]}") from None

    def tell(self, line: str = "go") -> None:
        """A line on its stdin (what it waits for)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)
        self._errors.close()
