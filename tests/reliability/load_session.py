"""One load process of tests/reliability/test_load.py: a session running a seeded mix of ops, checking every byte.

Its own module, importable as ``tests.reliability.load_session``, so that ``spawn`` children can import it
(pytest's importlib mode gives test modules names that child processes cannot import).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from cuctxd.client import Buffer, Client, UnknownHandle
from cuctxd.client.data_plane.transfers import RING_MIN_BYTES

DEVICES = 3
KiB = 1 << 10
#: Largest buffer a load process allocates; with at most :data:`MAX_LIVE` live, memory stays small.
MAX_BUFFER = 256 * KiB
MAX_LIVE = 8
CALL_TIMEOUT = 30.0


@dataclass
class Mirrored:
    """A buffer and what its bytes must be."""

    buffer: Buffer
    data: bytearray


class LoadSession:
    """The work of one process: a seeded mix of ops, each checked against a host mirror."""

    def __init__(self, client: Client, seed: int) -> None:
        self.client = client
        self.seed = seed
        self.rng = random.Random(seed)
        self.live: list[Mirrored] = []
        self.requests: Counter[str] = Counter()
        #: Devices whose staging ring this client has made.
        self.rings: set[int] = set()

    def pattern(self, size: int) -> bytes:
        """Bytes no other process writes: this process's seed, then random bytes."""
        head = bytes([0xC0 | self.seed]) * min(size, 4)
        return head + self.rng.randbytes(size - len(head))

    def span(self, size: int) -> tuple[int, int]:
        offset = self.rng.randrange(size)
        return offset, self.rng.randint(0, size - offset)

    def device(self) -> int:
        return self.rng.randrange(DEVICES)

    def pick(self) -> Mirrored:
        return self.rng.choice(self.live)

    # the ops ---------------------------------------------------------------------------------------

    def alloc(self) -> None:
        if len(self.live) >= MAX_LIVE:
            self.free()
        size = self.rng.randint(1, MAX_BUFFER)
        buffer = self.client.alloc(size, device=self.device(), shareable=self.rng.random() < 0.2)
        value = self.rng.randrange(256)
        buffer.fill(value)
        self.requests.update(["alloc", "fill"])
        self.live.append(Mirrored(buffer, bytearray([value]) * size))

    def write(self) -> None:
        target = self.pick()
        offset, size = self.span(target.buffer.size)
        data = self.pattern(size)
        assert target.buffer.write(data, offset) == size
        target.data[offset:offset + size] = data
        self.requests[self._wire_op("write", "memcpy_htod", size, target)] += 1

    def read(self) -> None:
        target = self.pick()
        offset, size = self.span(target.buffer.size)
        assert target.buffer.read(size, offset) == target.data[offset:offset + size], "read returned wrong bytes"
        self.requests[self._wire_op("read", "memcpy_dtoh", size, target)] += 1

    def _wire_op(self, frame_op: str, ring_op: str, size: int, target: Mirrored) -> str:
        """What one transfer sent: a payload frame, or (from RING_MIN_BYTES, through the staging ring)
        a DMA request."""
        return frame_op if size < RING_MIN_BYTES else self._ring_op(target.buffer.device, ring_op)

    def _ring_op(self, device: int, op: str) -> str:
        """``op`` through ``device``'s staging ring, counting the ``host_alloc`` that makes it the first time."""
        if device not in self.rings:
            self.rings.add(device)
            self.requests["host_alloc"] += 1
        return op

    def fill(self) -> None:
        target = self.pick()
        offset, size = self.span(target.buffer.size)
        value = self.rng.randrange(256)
        target.buffer.fill(value, offset, size)
        target.data[offset:offset + size] = bytes([value]) * size
        self.requests["fill"] += 1

    def copy(self) -> None:
        src, dst = self.pick(), self.pick()
        if src is dst:
            return self.read()
        size = self.rng.randint(0, min(src.buffer.size, dst.buffer.size))
        src_offset = self.rng.randint(0, src.buffer.size - size)
        dst_offset = self.rng.randint(0, dst.buffer.size - size)
        assert src.buffer.copy_to(dst.buffer, size, src_offset, dst_offset) == size
        dst.data[dst_offset:dst_offset + size] = src.data[src_offset:src_offset + size]
        self.requests["copy"] += 1
        return None

    def free(self) -> None:
        target = self.live.pop(self.rng.randrange(len(self.live)))
        assert target.buffer.read() == target.data, "a buffer's bytes changed before its free"
        target.buffer.free()
        self.requests.update([self._wire_op("read", "memcpy_dtoh", target.buffer.size, target), "free"])

    def context(self) -> None:
        """A created context used for a transfer large enough for the staging ring (which the client may
        make right then, in that context), then destroyed: the ring must outlive it (later transfers of
        the session on that device go through the same ring)."""
        device = self.device()
        before = [c.handle for c in self.client.context_stack(device)]
        created = self.client.create_context(device=device)
        size = RING_MIN_BYTES + self.rng.randrange(64 * KiB)
        buffer = self.client.alloc(size, device=device)
        assert buffer.context == created.handle
        data = self.pattern(size)
        buffer.write(data)
        assert buffer.read() == data
        assert [c.handle for c in self.client.context_stack(device)] == [*before, created.handle]
        created.destroy()
        try:
            buffer.read(1)
        except UnknownHandle:
            pass
        else:
            raise AssertionError("a buffer outlived the context it was allocated in")
        assert [c.handle for c in self.client.context_stack(device)] == before
        self.requests.update(["context_stack", "create_context", "alloc", self._ring_op(device, "memcpy_htod"),
                              "memcpy_dtoh", "context_stack", "destroy_context", "read", "context_stack"])

    def stream(self) -> None:
        target = self.pick()
        device = target.buffer.device
        stream = self.client.create_stream(device)
        event = self.client.create_event(device)
        offset, size = self.span(target.buffer.size)
        data = self.pattern(size)
        target.buffer.write(data, offset, stream=stream)
        value = self.rng.randrange(256)
        target.buffer.fill(value, offset, size // 2, stream=stream)
        target.data[offset:offset + size] = bytes([value]) * (size // 2) + data[size // 2:]
        event.record(stream)
        assert target.buffer.read(size, offset, stream=stream) == target.data[offset:offset + size]
        event.synchronize()
        stream.synchronize()
        event.destroy()
        stream.destroy()
        self.requests.update(["create_stream", "create_event", "write", "fill", "record_event", "read",
                              "event_synchronize", "stream_synchronize", "destroy_event", "destroy_stream"])

    def pipeline(self) -> None:
        target = self.pick()
        chunks = self.rng.randint(2, 16)
        step = max(1, target.buffer.size // chunks)
        reads = []
        with self.client.pipeline() as pipe:
            for offset in range(0, target.buffer.size, step):
                data = self.pattern(min(step, target.buffer.size - offset))
                pipe.write(target.buffer, data, offset)
                target.data[offset:offset + len(data)] = data
                reads.append((offset, len(data), pipe.read(target.buffer, len(data), offset)))
                self.requests.update(["write", "read"])
        for offset, size, call in reads:
            assert call.result() == target.data[offset:offset + size], "a pipelined read got another's reply"

    def mem_get_info(self) -> None:
        free, total = self.client.mem_get_info(self.device())
        assert 0 <= free <= total == 64 << 20
        self.requests["mem_get_info"] += 1

    MIX = (("alloc", 3), ("write", 5), ("read", 5), ("fill", 3), ("copy", 4), ("free", 2), ("context", 2),
           ("stream", 1), ("pipeline", 1), ("mem_get_info", 1))

    def run(self, ops: int) -> None:
        names, weights = zip(*self.MIX, strict=True)
        for _ in range(ops):
            name = self.rng.choices(names, weights)[0]
            if not self.live and name not in ("alloc", "context", "mem_get_info"):
                name = "alloc"
            getattr(self, name)()
        while self.live:
            self.free()
        self.requests["shm_lane"] += len(self.client.shm_lanes)  # one per device, opened by the client


def load_process(endpoint: str, seed: int, ops: int) -> dict[str, Any]:
    """Run in a spawned process: one session's share of the load; returns what it sent."""
    with Client(endpoint, timeout=CALL_TIMEOUT, name=f"load-{seed}", heartbeat=False) as client:
        session = LoadSession(client, seed)
        session.run(ops)
        session_id = client.session_id
    session.requests.update(["hello", "goodbye"])
    return {"seed": seed, "session": session_id, "requests": dict(session.requests)}
