"""Framing: requests and replies as msgpack header frames plus raw payload frames.

A request is ``[header, *payload]`` sent from a DEALER; the header is a msgpack
map ``{id, op, session?, args?}``. A reply is ``[header, *payload]`` with header
``{id, ok: true, result}`` or ``{id, ok: false, error: {code, name, message}}``.
Bulk bytes never go through msgpack.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import msgpack

from cuctxd.protos.errors import BadOp, BadRequest, CuctxError, TooLarge, error_to_wire
from cuctxd.protos.limits import MAX_HANDLE, MAX_HEADER_BYTES
from cuctxd.protos.schema import OPS, OpSpec


class RequestHeader(NamedTuple):
    """A decoded request header whose op is known; ``args`` is still unchecked."""

    id: int
    spec: OpSpec
    session: str | None
    args: Any


_packers = threading.local()


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` with this thread's own Packer (``packb`` builds a new one per call, which
    costs more than packing a reply header; a Packer must not be shared between threads)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


def unpack(buf: bytes | memoryview) -> Any:
    """Decode one msgpack value, or raise :class:`BadRequest`."""
    if len(buf) > MAX_HEADER_BYTES:
        raise TooLarge(f"header frame of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise BadRequest(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc


def request_id_of(header: Any) -> int:
    """The request id if the header has a usable one, else 0 (for replies to garbage)."""
    if isinstance(header, dict):
        rid = header.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_HANDLE:
            return rid
    return 0


def parse_request(header: Any) -> RequestHeader:
    """Check a decoded header's envelope and look its op up; raise on anything off."""
    if not isinstance(header, dict):
        raise BadRequest(f"header must be a map, got {type(header).__name__}")
    rid = header.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= MAX_HANDLE:
        raise BadRequest("header field 'id' must be an unsigned 63-bit integer")
    name = header.get("op")
    if not isinstance(name, str):
        raise BadRequest("header field 'op' must be a string")
    spec = OPS.get(name)
    if spec is None:
        raise BadOp(f"unknown op {name[:64]!r}")
    session = header.get("session")
    if session is not None and not isinstance(session, str):
        raise BadRequest("header field 'session' must be a string")
    return RequestHeader(rid, spec, session, header.get("args"))


def encode_request(request_id: int, op: str, session: str | None, args: dict[str, Any]) -> bytes:
    header: dict[str, Any] = {"id": request_id, "op": op}
    if session is not None:
        header["session"] = session
    if args:
        header["args"] = args
    return pack(header)


def encode_result(request_id: int, result: dict[str, Any]) -> bytes:
    """The reply header of a success; a ``CUCTXD_ERROR_TOO_LARGE`` error instead if it would exceed
    ``MAX_HEADER_BYTES`` (a client discards such a header, so the request would look unanswered)."""
    header = pack({"id": request_id, "ok": True, "result": result})
    if len(header) > MAX_HEADER_BYTES:
        return encode_error(request_id, TooLarge(
            f"the reply header would take {len(header)} bytes, over MAX_HEADER_BYTES ({MAX_HEADER_BYTES})"))
    return header


def encode_error(request_id: int, error: CuctxError) -> bytes:
    return pack({"id": request_id, "ok": False, "error": error_to_wire(error)})


class ReplyHeader(NamedTuple):
    """A decoded reply header; exactly one of ``result``/``error`` is set."""

    id: int
    result: dict[str, Any] | None
    error: dict[str, Any] | None


def parse_reply(buf: bytes | memoryview) -> ReplyHeader:
    header = unpack(buf)
    if not isinstance(header, dict) or "id" not in header or "ok" not in header:
        raise BadRequest("reply header is not a cuctxd reply")
    if header["ok"]:
        return ReplyHeader(int(header["id"]), dict(header.get("result") or {}), None)
    return ReplyHeader(int(header["id"]), None, dict(header.get("error") or {}))
