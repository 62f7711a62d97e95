"""The shm lane's layout (PROTOCOL.md, "The shm lane"): device ops of one session to one device through
shared memory, woken by eventfds instead of ZeroMQ.

A region of :data:`REGION_BYTES` (a memfd): the request area at 0, the reply area at
:data:`AREA_BYTES`, then :data:`CONTROL_BYTES` whose first 4 (:data:`CLOSED_AT`) the daemon
sets to 1 when it closes the lane (it then rings the reply eventfd once more), and whose
u64 at :data:`EARLY_AT` the client sets to the sequence number of an **early** request
(sent before the bytes it copies from are in place; it rings once more when they are). Each area
holds one message: :data:`MESSAGE_HEAD` (``<QIII``: sequence number, header length, payload
frames (0 or 1), payload length), the msgpack header, the payload. A client writes a request
(sequence numbers 1, 2, 3, ...), then adds 1 to the request eventfd; the daemon answers in
the reply area under the same number, then adds 1 to the reply eventfd. One request at a time.
"""

from __future__ import annotations

import os
import struct

from cuctxd.protos.errors import BadRequest

#: Bytes of each area; a message must fit in one.
AREA_BYTES = 64 << 10
CONTROL_BYTES = 64
REGION_BYTES = 2 * AREA_BYTES + CONTROL_BYTES
REQUEST_AT = 0
REPLY_AT = AREA_BYTES
CLOSED_AT = 2 * AREA_BYTES
EARLY_AT = CLOSED_AT + 8
_FLAG = struct.Struct("<I")
_SEQ = struct.Struct("<Q")
MESSAGE_HEAD = struct.Struct("<QIII")
#: Most header + payload bytes one message carries.
MAX_MESSAGE_BYTES = AREA_BYTES - MESSAGE_HEAD.size
#: Fewest CPUs on which a waiting thread polls before it sleeps (PROTOCOL.md, "Polling before sleeping"):
#: on smaller hosts the polling would take the CPU the other side needs.
BUSY_POLL_MIN_CPUS = 8


def polls_busily() -> bool:
    """Whether this host has the CPUs for the daemon's workers and the client to poll before sleeping."""
    return (os.cpu_count() or 1) >= BUSY_POLL_MIN_CPUS


def fits(header: int, payload: int) -> bool:
    """Whether a message of ``header`` + ``payload`` bytes fits in an area."""
    return header + payload <= MAX_MESSAGE_BYTES


def write_message(region: memoryview, at: int, seq: int, header: bytes, payload: bytes | memoryview | None) -> None:
    """Put one message in the area at ``at`` (the caller checked :func:`fits`); ``payload`` None: no frame."""
    frames, size = (0, 0) if payload is None else (1, len(payload))
    start = at + MESSAGE_HEAD.size
    region[start:start + len(header)] = header
    if payload is not None:
        region[start + len(header):start + len(header) + size] = payload
    MESSAGE_HEAD.pack_into(region, at, seq, len(header), frames, size)


def mark_closed(region: memoryview) -> None:
    _FLAG.pack_into(region, CLOSED_AT, 1)


def is_closed(region: memoryview) -> bool:
    return bool(_FLAG.unpack_from(region, CLOSED_AT)[0])


def mark_early(region: memoryview, seq: int) -> None:
    """Say that request ``seq`` is early (written before the request itself is rung)."""
    _SEQ.pack_into(region, EARLY_AT, seq)


def is_early(region: memoryview, seq: int) -> bool:
    return bool(_SEQ.unpack_from(region, EARLY_AT)[0] == seq)


def read_message(region: memoryview, at: int) -> tuple[int, bytes, bytes | None]:
    """``(seq, header, payload or None)`` of the area at ``at``, copied out first (the other side may be
    writing); :class:`BadRequest` for lengths that do not fit the area."""
    seq, header_len, frames, size = MESSAGE_HEAD.unpack_from(region, at)
    if frames > 1 or header_len + size > MAX_MESSAGE_BYTES or (frames == 0 and size):
        raise BadRequest(f"shm lane message {seq}: {header_len} header bytes and {frames} frame(s) of {size} "
                         f"bytes do not fit a {AREA_BYTES}-byte area")
    start = at + MESSAGE_HEAD.size
    header = bytes(region[start:start + header_len])
    payload = bytes(region[start + header_len:start + header_len + size]) if frames else None
    return seq, header, payload
