"""The fd channel's wire format (PROTOCOL.md, "The fd channel"): where it listens, its request and reply.

ZeroMQ cannot carry file descriptors, so beside each ipc:// endpoint the daemon
listens on a Unix stream socket at the endpoint's path plus :data:`SUFFIX`. A
client redeems there a ticket that a ZeroMQ reply gave it: it sends
:data:`REQUEST_MAGIC` and the ticket's :data:`TICKET_BYTES` raw bytes, and reads a
4-byte big-endian length and that many bytes of msgpack, the fds arriving with
the reply's first bytes (``SCM_RIGHTS``).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

#: What the channel's socket path adds to the ipc:// endpoint's.
SUFFIX = ".fds"
#: A request: these 4 bytes, then the ticket.
REQUEST_MAGIC = b"CFD1"
#: A ticket: an 8-byte public id, then a 32-byte secret; written as 80 lowercase hex characters.
TICKET_ID_BYTES = 8
TICKET_BYTES = TICKET_ID_BYTES + 32
REQUEST_BYTES = len(REQUEST_MAGIC) + TICKET_BYTES
#: Largest reply body (msgpack) either side accepts, and most fds one reply carries.
MAX_REPLY_BYTES = 4096
MAX_FDS = 16
_LENGTH = struct.Struct(">I")


def channel_path(endpoint: str) -> str | None:
    """The channel's socket path beside an ipc:// endpoint (``@name`` for Linux's abstract
    namespace, as ZeroMQ spells it); None for other transports."""
    if not endpoint.startswith("ipc://"):
        return None
    return endpoint[len("ipc://"):] + SUFFIX


def socket_address(path: str) -> str:
    """What ``socket.bind``/``connect`` take for a channel path (abstract names start with NUL)."""
    return "\0" + path[1:] if path.startswith("@") else path


def ticket_bytes(ticket: str) -> bytes:
    """The raw bytes of a ticket as written in a reply; ValueError if it is not one."""
    raw = bytes.fromhex(ticket)
    if len(raw) != TICKET_BYTES:
        raise ValueError(f"a ticket is {TICKET_BYTES} bytes, got {len(raw)}")
    return raw


def encode_request(ticket: str) -> bytes:
    return REQUEST_MAGIC + ticket_bytes(ticket)


def parse_request(data: bytes) -> bytes:
    """The ticket of a whole request; ValueError if the bytes are not one."""
    if len(data) != REQUEST_BYTES or not data.startswith(REQUEST_MAGIC):
        raise ValueError("not an fd channel request")
    return data[len(REQUEST_MAGIC):]


def encode_reply(body: dict[str, Any]) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    return _LENGTH.pack(len(packed)) + packed


def reply_length(header: bytes) -> int:
    """The body length a reply's first 4 bytes announce; ValueError beyond :data:`MAX_REPLY_BYTES`."""
    (length,) = _LENGTH.unpack(header)
    if length > MAX_REPLY_BYTES:
        raise ValueError(f"an fd channel reply of {length} bytes is too long")
    return length


def decode_reply(body: bytes) -> dict[str, Any]:
    decoded = msgpack.unpackb(body, raw=False)
    if not isinstance(decoded, dict):
        raise ValueError("an fd channel reply must be a map")
    return decoded
