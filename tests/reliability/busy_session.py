"""One busy client process of tests/reliability/test_restart_and_drain_under_load.py: it runs single-request
ops back to back (shm lanes, the staging ring and the socket all carry some) until its daemon is gone, and
records when each op started and how it ended.

Its own module, importable as ``tests.reliability.busy_session``, so that ``spawn`` children can import it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from cuctxd.client import Client, CuctxError
from cuctxd.protos.errors import ShuttingDown

KiB = 1 << 10
#: Sizes a busy process writes: a payload frame, and one request through the staging ring.
SMALL, RING = 4 * KiB, 96 * KiB


Outcome = tuple[float, float, str]


def busy_process(endpoint: str, seed: int, started: Any, devices: int, timeout: float = 20.0) -> list[Outcome]:
    """Run until the daemon is gone; ``started`` (a multiprocessing Event-like ``set``) is set once every
    path has carried a request. Returns ``(start, end, outcome)`` per op, on the system-wide monotonic clock:
    ``ok``, or the error's name (``CUCTXD_SESSION_LOST`` once the daemon is found gone)."""
    outcomes: list[Outcome] = []
    with Client(endpoint, timeout=timeout, name=f"busy-{seed}", heartbeat=False) as client:
        buffers = [client.alloc(RING, device=device) for device in range(devices)]
        ops = itertools.cycle([
            lambda b: b.fill(seed),                                   # the shm lane
            lambda b: b.write(bytes([seed]) * RING),                  # the staging ring (memcpy_htod)
            lambda b: b.write(bytes([seed]) * SMALL),                 # a payload frame on the socket
            lambda b: b.read(SMALL),
        ])
        for count in itertools.count():
            buffer = buffers[count % devices]
            op = next(ops)
            begin = time.monotonic()
            try:
                op(buffer)
            except ShuttingDown as error:  # the daemon drains: it answers, and exits soon
                outcomes.append((begin, time.monotonic(), error.name))
                time.sleep(0.002)
                continue
            except CuctxError as error:
                outcomes.append((begin, time.monotonic(), error.name))
                return outcomes
            outcomes.append((begin, time.monotonic(), "ok"))
            if count == 8:
                started.set()
    return outcomes
