"""Client processes the fault tests kill: in their own module so that ``spawn`` children can import them."""

from __future__ import annotations

from multiprocessing.connection import Connection

from cuctxd.client import Client

MiB = 1 << 20


def transfer_forever(endpoint: str, mode: str, ticks: Connection) -> None:
    """Run in a spawned process until killed: large transfers back to back, a tick after each."""
    pattern = bytes(range(256)) * (12 * MiB // 256)
    with Client(endpoint, timeout=30, name=f"victim-{mode}") as client:
        big = client.alloc(len(pattern), device=0)
        other = client.alloc(3 * MiB, device=1, shareable=True)
        client.create_context(device=1)
        stream = client.create_stream(device=0)
        big.write(pattern)
        ticks.send(client.session_id)
        while True:
            if mode == "writes":
                big.write(pattern)  # 12 MiB: pipelined 4 MiB chunks
            elif mode == "reads":
                assert big.read() == pattern
            else:  # many requests in flight at once, on a stream and across devices
                with client.pipeline() as pipe:
                    for offset in range(0, len(pattern), 256 * 1024):
                        pipe.write(big, pattern[offset:offset + 256 * 1024], offset, stream=stream)
                    pipe.copy(big, other, 3 * MiB)
            ticks.send(0)
