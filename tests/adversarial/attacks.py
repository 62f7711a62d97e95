"""Shared helpers of the adversarial suite: the bystander, the daemon's RSS, raw connections, soak scaling.

Every adversarial test asserts three things while (or right after) its attack runs:

* the daemon is alive: :func:`assert_alive`;
* a *bystander* session is unaffected: its buffer still holds its bytes and one
  op is answered within a stated bound (:class:`Bystander`, :func:`open_bystander`,
  or the ``bystander`` fixture of ``conftest.py``);
* the daemon's memory stays under a stated ceiling: :func:`rss_bytes` reads
  ``VmRSS`` from ``/proc/<pid>/status``.

Attacks speak the public protocol only. :class:`tests.helpers_raw.RawPeer` sends
hand-built headers; :func:`flood` sends many requests without reading a reply
(what a client that never reads does), :func:`idle_connections` opens
connections that send nothing.

``CUCTXD_SOAK=1`` turns the suite into a long soak: :func:`scaled` multiplies
the counts a test passes through it (by ``CUCTXD_SOAK_FACTOR``, default 50).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import zmq

from cuctxd import Client
from cuctxd.client.api.objects import Buffer
from cuctxd.protos.messages import pack
from tests.helpers import DaemonProcess, pattern, running_daemon
from tests.helpers_raw import RawPeer
from tests.reliability.strategies import scaled, soak_mode

__all__ = ["BYSTANDER_BOUND_S", "BYSTANDER_SIZE", "FIGURES", "Bystander", "assert_alive", "attacked_daemon",
           "call_many", "flood", "idle_connections", "open_bystander", "rss_bytes", "scaled", "soak_mode"]

#: Figures printed in the terminal summary (``conftest.py``): test name -> lines. Here, not in the
#: conftest, because pytest's importlib mode loads a conftest apart from its importable module.
FIGURES: dict[str, list[str]] = {}
#: Bytes in the bystander's buffer.
BYSTANDER_SIZE = 64 * 1024
#: Default bound, in seconds, on one bystander op while an attack runs (generous: CI machines are slow and
#: shared; an attack that stalls a device does so for many seconds).
BYSTANDER_BOUND_S = 2.0


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` in bytes (``VmRSS`` of ``/proc/<pid>/status``).

    Raises ``FileNotFoundError`` if the process is gone, AssertionError if it is a zombie (no VmRSS).
    """
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                value, unit = line.split()[1:3]
                assert unit == "kB", line
                return int(value) * 1024
    raise AssertionError(f"process {pid} has no VmRSS (a zombie?)")


def assert_alive(daemon: DaemonProcess) -> None:
    """The daemon process has not exited; the message carries the end of its log if it has."""
    code = daemon.process.poll()
    assert code is None, f"cuctxd exited with {code}:\n{daemon.log()[-5000:]}"


@contextmanager
def attacked_daemon(*extra: str, open_files: int | None = None) -> Iterator[DaemonProcess]:
    """The daemon of ``conftest.py``'s ``attack_daemon`` (two sim devices of 256 MiB, ``extra`` options, ``open_files``
    its RLIMIT_NOFILE) for the block: still alive at its end, then it must exit 0 having logged no traceback. A
    module whose attacks all end with their own sessions shares one (a module-scoped ``attack_daemon``)."""
    with running_daemon("--sim-devices", "2", "--sim-memory", "256MiB", *extra, open_files=open_files,
                        clean_log=True) as process:
        yield process
        assert_alive(process)


@dataclass
class Bystander:
    """An innocent session with a buffer of known bytes, on its own connection.

    :meth:`check` reads the buffer back and asserts both that it holds its bytes
    and that the read was answered within ``bound_s`` seconds. Call it while an
    attack runs and after it. Use from one thread at a time.
    """

    client: Client
    buffer: Buffer
    data: bytes
    bound_s: float = BYSTANDER_BOUND_S

    def check(self, bound_s: float | None = None) -> float:
        """Read the buffer: AssertionError if a byte differs or the read took longer than the bound
        (``bound_s``, default :attr:`bound_s`); returns the read's seconds."""
        bound = self.bound_s if bound_s is None else bound_s
        started = time.monotonic()
        got = self.client.read(self.buffer)
        took = time.monotonic() - started
        assert got == self.data, "the bystander's buffer no longer holds its bytes"
        assert took <= bound, f"the bystander's read took {took:.3f} s, over its bound of {bound} s"
        return took


@contextmanager
def open_bystander(endpoint: str, device: int = 0, size: int = BYSTANDER_SIZE,
                   bound_s: float = BYSTANDER_BOUND_S) -> Iterator[Bystander]:
    """A :class:`Bystander` on ``endpoint`` (its own session, lease kept by heartbeats), its buffer on
    ``device`` filled with a pattern; checked once on the way in."""
    with Client(endpoint, timeout=max(30.0, 4 * bound_s), name="bystander") as client:
        data = pattern(size, seed=99)
        buffer = client.alloc(size, device=device)
        client.write(buffer, data)
        bystander = Bystander(client, buffer, data, bound_s)
        bystander.check()
        yield bystander


def flood(peer: RawPeer, op: str, args: dict[str, Any] | None, session: str | None, count: int,
          payload: Sequence[bytes] = ()) -> list[int]:
    """Send ``count`` copies of one request on ``peer`` without reading any reply; their ids.

    ZeroMQ queues what the daemon cannot take yet; sends never block here
    (``zmq.Again`` ends the flood early: the ids returned are those sent).
    """
    ids: list[int] = []
    for _ in range(count):
        rid = peer.next_id()
        header: dict[str, Any] = {"id": rid, "op": op}
        if session is not None:
            header["session"] = session
        if args is not None:
            header["args"] = args
        try:
            peer.socket.send_multipart([pack(header), *payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            break
        ids.append(rid)
    return ids


def call_many(peer: RawPeer, op: str, args: Sequence[dict[str, Any]], session: str,
              window: int = 256) -> list[dict[str, Any]]:
    """Send one ``op`` request per entry of ``args``, pipelined ``window`` at a time, and return the
    results in order; AssertionError on any error reply. The quick way to make thousands of objects."""
    results: list[dict[str, Any]] = []
    for start in range(0, len(args), window):
        ids = [peer.send(op, a, session) for a in args[start:start + window]]
        replies = {}
        for _ in ids:
            header, _frames = peer.recv()
            replies[header["id"]] = header
        for rid in ids:
            assert replies[rid]["ok"] is True, f"{op} failed: {replies[rid].get('error')}"
            results.append(replies[rid]["result"])
    return results


@contextmanager
def idle_connections(endpoint: str, count: int) -> Iterator[list[zmq.Socket[Any]]]:
    """``count`` DEALER sockets connected to ``endpoint`` that send nothing; closed on exit."""
    context = zmq.Context.instance()
    with ExitStack() as stack:
        sockets = []
        for _ in range(count):
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            stack.callback(socket.close)
            socket.connect(endpoint)
            sockets.append(socket)
        yield sockets
