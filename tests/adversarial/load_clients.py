"""The client processes of ``test_load_kills``: module-level so that a child process can import them (pytest runs
in importlib mode, so a target defined in a test module could not be found by the child).

Each process opens a session, keeps a host mirror of its own buffers and runs
verified data ops: every read is compared with what this process wrote (a
pattern carrying its seed and the op's number), so a reply meant for another
session, or bytes another session wrote, shows as a mismatch. It puts
``("started", seed, session_id)`` on the queue once its buffers are written,
and ``("done", seed, report)`` at the end, unless it is killed first.
"""

from __future__ import annotations

import random
from collections import Counter
from multiprocessing.connection import Connection

from cuctxd import Client
from cuctxd.protos.errors import CuctxError

#: Bytes in each of a process's buffers, and how many it has per device.
BUFFER_SIZE = 256 * 1024
BUFFERS = 2
DEVICES = 2
CALL_TIMEOUT = 60.0


def stamp(seed: int, op: int, size: int) -> bytes:
    """``size`` bytes that only process ``seed`` writes, in its op number ``op``."""
    head = f"<{seed}:{op}>".encode()
    return (head * (size // len(head) + 1))[:size]


def verified_client(endpoint: str, seed: int, ops: int, results: Connection) -> None:
    """Run ``ops`` random write/fill/read/copy ops, checking every read; report on the pipe ``results``."""
    rng = random.Random(seed)
    requests: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    mismatches = 0
    with Client(endpoint, timeout=CALL_TIMEOUT, name=f"load-{seed}") as client:
        buffers = [client.alloc(BUFFER_SIZE, device=i % DEVICES) for i in range(BUFFERS * DEVICES)]
        mirrors = [bytearray(stamp(seed, -1, BUFFER_SIZE)) for _ in buffers]
        for buffer, mirror in zip(buffers, mirrors, strict=True):
            client.write(buffer, bytes(mirror))
        results.send(("started", client.session_id))
        for number in range(ops):
            index = rng.randrange(len(buffers))
            buffer, mirror = buffers[index], mirrors[index]
            offset = rng.randrange(BUFFER_SIZE)
            size = rng.randint(1, min(16 * 1024, BUFFER_SIZE - offset))
            kind = rng.choice(("write", "write", "fill", "read", "read", "copy"))
            requests[kind] += 1
            try:
                if kind == "write":
                    data = stamp(seed, number, size)
                    client.write(buffer, data, offset)
                    mirror[offset:offset + size] = data
                elif kind == "fill":
                    value = (seed * 31 + number) % 256
                    client.fill(buffer, value, offset, size)
                    mirror[offset:offset + size] = bytes([value]) * size
                elif kind == "copy":
                    other = (index + DEVICES) % len(buffers)  # same device: a copy within the daemon
                    client.copy(buffer, buffers[other], size, offset, offset)
                    mirrors[other][offset:offset + size] = mirror[offset:offset + size]
                else:
                    mismatches += client.read(buffer, size, offset) != bytes(mirror[offset:offset + size])
            except CuctxError as exc:
                errors[exc.name] += 1
        for buffer, mirror in zip(buffers, mirrors, strict=True):  # every byte, at the end
            requests["read"] += 1
            mismatches += client.read(buffer) != bytes(mirror)
    results.send(("done", {"requests": dict(requests), "errors": dict(errors), "mismatches": mismatches}))
