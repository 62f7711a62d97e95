"""Argument and envelope checking at the daemon's front door, and the error mapping."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from cuctxd.protos import errors
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import (
    BadArgument,
    BadOp,
    BadRequest,
    CuctxError,
    CudaError,
    DaemonError,
    TooLarge,
    error_from_wire,
    error_to_wire,
)
from cuctxd.protos.limits import MAX_HANDLE, MAX_HEADER_BYTES
from cuctxd.protos.messages import (
    encode_error,
    encode_request,
    encode_result,
    pack,
    parse_reply,
    parse_request,
    request_id_of,
    unpack,
)
from cuctxd.protos.schema import OPS, decode_args, encode_args

# --- decode_args -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "args", "field"),
    [
        ("alloc", {"size": True}, "size"),
        ("alloc", {"size": "16"}, "size"),
        ("alloc", {"size": 1.5}, "size"),
        ("alloc", {"size": -1}, "size"),
        ("alloc", {"size": 16, "device": -1}, "device"),
        ("alloc", {"size": 16, "device": False}, "device"),
        ("alloc", {"size": MAX_HANDLE + 1}, "size"),
        ("free", {"buffer": 0}, "buffer"),
        ("free", {"buffer": -5}, "buffer"),
        ("free", {"buffer": MAX_HANDLE + 1}, "buffer"),
        ("free", {"buffer": "0x10"}, "buffer"),
        ("fill", {"buffer": 1, "value": 256}, "value"),
        ("fill", {"buffer": 1, "value": -1}, "value"),
        ("fill", {"buffer": 1, "offset": -1}, "offset"),
        ("read", {"buffer": 1, "size": -1}, "size"),
        ("read", {"buffer": 1, "size": [4]}, "size"),
        ("write", {"buffer": 1, "offset": {"a": 1}}, "offset"),
        ("copy", {"src": 1, "dst": 2, "dst_offset": -3}, "dst_offset"),
        ("copy", {"src": 1, "dst": 2, "dst_device": True}, "dst_device"),
        ("push_context", {"context": True}, "context"),
        ("create_context", {"flags": -1}, "flags"),
        ("hello", {"protocol": 1, "client": 7}, "client"),
        ("hello", {"protocol": 1, "client": "x" * 5000}, "client"),
        ("hello", {"protocol": 1, "pid": -1}, "pid"),
        ("hello", {"protocol": "1"}, "protocol"),
    ],
)
def test_wrong_argument_raises_bad_argument_naming_the_field(op: str, args: dict[str, Any], field: str) -> None:
    with pytest.raises(BadArgument) as info:
        decode_args(OPS[op], args)
    assert f"'{field}'" in info.value.message
    assert info.value.name == "CUCTXD_ERROR_BAD_ARGUMENT"


@pytest.mark.parametrize(
    ("op", "args", "field"),
    [
        ("alloc", {}, "size"),
        ("alloc", {"size": None}, "size"),
        ("free", {}, "buffer"),
        ("copy", {"src": 1}, "dst"),
        ("push_context", {"device": 0}, "context"),
        ("hello", {"client": "x"}, "protocol"),
    ],
)
def test_missing_required_argument_raises_bad_argument_naming_it(op: str, args: dict[str, Any], field: str) -> None:
    with pytest.raises(BadArgument, match=f"needs argument '{field}'"):
        decode_args(OPS[op], args)


@pytest.mark.parametrize("raw", [[1, 2], "size=4", 5, b"\x80", True])
def test_args_that_are_not_a_map_raise_bad_argument(raw: Any) -> None:
    with pytest.raises(BadArgument, match="'args' of alloc must be a map"):
        decode_args(OPS["alloc"], raw)


def test_absent_args_mean_no_arguments() -> None:
    assert decode_args(OPS["ping"], None) == OPS["ping"].args_type()
    with pytest.raises(BadArgument, match="needs argument 'size'"):
        decode_args(OPS["alloc"], None)


def test_unknown_arguments_are_refused_by_name() -> None:
    with pytest.raises(BadArgument) as refused:
        decode_args(OPS["write"], {"buffer": 9, "ofset": 64})
    assert "'ofset'" in refused.value.message


def test_defaults_apply_and_explicit_nulls_mean_default() -> None:
    args = decode_args(OPS["fill"], {"buffer": 9, "offset": None, "size": None})
    assert (args.buffer, args.value, args.offset, args.size, args.device) == (9, 0, 0, None, None)


def test_boundary_values_are_accepted() -> None:
    args = decode_args(OPS["fill"], {"buffer": MAX_HANDLE, "value": 255, "offset": 0, "size": MAX_HANDLE})
    assert (args.buffer, args.value, args.size) == (MAX_HANDLE, 255, MAX_HANDLE)
    assert decode_args(OPS["free"], {"buffer": 1}).buffer == 1
    assert decode_args(OPS["alloc"], {"size": 0}).size == 0


def test_encode_args_round_trips_through_decode_args() -> None:
    args = decode_args(OPS["copy"], {"src": 3, "dst": 4, "size": 10, "dst_offset": 2})
    wire = encode_args(args)
    assert "dst_device" not in wire  # None fields are left out
    assert decode_args(OPS["copy"], wire) == args


# --- parse_request ---------------------------------------------------------------------


@pytest.mark.parametrize("header", [[1, "ping"], "ping", 7, None, b"\x81"])
def test_header_that_is_not_a_map_is_bad_request(header: Any) -> None:
    with pytest.raises(BadRequest, match="header must be a map"):
        parse_request(header)


@pytest.mark.parametrize(
    "header",
    [
        {"op": "ping"},
        {"id": None, "op": "ping"},
        {"id": -1, "op": "ping"},
        {"id": True, "op": "ping"},
        {"id": 1.0, "op": "ping"},
        {"id": "1", "op": "ping"},
        {"id": MAX_HANDLE + 1, "op": "ping"},
    ],
)
def test_missing_or_bad_id_is_bad_request(header: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="'id'"):
        parse_request(header)
    assert request_id_of(header) == 0


@pytest.mark.parametrize("name", [None, 3, b"ping", ["ping"]])
def test_non_string_op_is_bad_request(name: Any) -> None:
    header = {"id": 1} if name is None else {"id": 1, "op": name}
    with pytest.raises(BadRequest, match="'op'"):
        parse_request(header)


@pytest.mark.parametrize("name", ["", "PING", "launch_kernel", "x" * 1000])
def test_unknown_op_is_bad_op(name: str) -> None:
    with pytest.raises(BadOp) as info:
        parse_request({"id": 5, "op": name})
    assert info.value.name == "CUCTXD_ERROR_BAD_OP"
    assert len(info.value.message) < 200  # a huge op name is not echoed back whole


def test_non_string_session_is_bad_request() -> None:
    with pytest.raises(BadRequest, match="'session'"):
        parse_request({"id": 1, "op": "ping", "session": 12})


def test_good_header_parses() -> None:
    request = parse_request(unpack(encode_request(42, "alloc", "tok", {"size": 8})))
    assert request.id == 42
    assert request.spec is OPS["alloc"]
    assert request.session == "tok"
    assert request.args == {"size": 8}
    assert request_id_of({"id": 42}) == 42


# --- unpack ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "buf",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa2id", b"\xdd\xff\xff\xff\xff", pack({"id": 1}) + b"\x00"],
    ids=["empty", "reserved-byte", "short-array", "short-map", "huge-array-length", "trailing-bytes"],
)
def test_invalid_msgpack_is_bad_request(buf: bytes) -> None:
    with pytest.raises(BadRequest, match="not valid msgpack"):
        unpack(buf)


def test_oversized_header_is_too_large() -> None:
    with pytest.raises(TooLarge):
        unpack(b"\x00" * (MAX_HEADER_BYTES + 1))
    assert unpack(pack("x" * (MAX_HEADER_BYTES - 16))) == "x" * (MAX_HEADER_BYTES - 16)


# --- replies ---------------------------------------------------------------------------


def test_replies_round_trip() -> None:
    ok = parse_reply(encode_result(7, {"count": 2}))
    assert (ok.id, ok.result, ok.error) == (7, {"count": 2}, None)
    failed = parse_reply(encode_error(8, BadOp("nope")))
    assert failed.id == 8
    assert failed.result is None
    assert failed.error == {"code": 10002, "name": "CUCTXD_ERROR_BAD_OP", "message": "nope"}


@pytest.mark.parametrize("buf", [pack([1]), pack({"id": 1}), pack({"ok": True}), b"\xc1"])
def test_a_reply_that_is_not_one_is_bad_request(buf: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_reply(buf)


# --- error_from_wire -------------------------------------------------------------------


def _daemon_error_classes() -> list[type[DaemonError]]:
    found: list[type[DaemonError]] = []
    pending = list(DaemonError.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


def test_every_error_code_has_one_class() -> None:
    codes = [int(cls.code_enum) for cls in _daemon_error_classes()]
    assert len(codes) == len(set(codes))
    assert set(codes) == {int(code) for code in errors.ErrorCode}


@pytest.mark.parametrize("cls", _daemon_error_classes(), ids=lambda c: c.__name__)
def test_every_daemon_error_round_trips(cls: type[DaemonError]) -> None:
    original = cls("something specific went wrong")
    wire = msgpack.unpackb(pack(error_to_wire(original)), raw=False)
    rebuilt = error_from_wire(wire, op="alloc")
    assert type(rebuilt) is cls
    assert (rebuilt.code, rebuilt.name, rebuilt.message) == (original.code, original.name, original.message)
    assert rebuilt.op == "alloc"
    assert "alloc: " in str(rebuilt)


@pytest.mark.parametrize("result", [r for r in CUresult if r != CUresult.CUDA_SUCCESS], ids=lambda r: r.name)
def test_cuda_errors_round_trip_with_code_name_and_message(result: CUresult) -> None:
    original = CudaError.of(result, "detail here")
    rebuilt = error_from_wire(error_to_wire(original))
    assert type(rebuilt) is CudaError
    assert rebuilt.code == int(result)
    assert rebuilt.name == result.name
    assert rebuilt.message == original.message
    assert rebuilt.message.endswith("(detail here)")


def test_a_cuda_code_missing_from_our_table_keeps_its_name() -> None:
    rebuilt = error_from_wire({"code": 301, "name": "CUDA_ERROR_FILE_NOT_FOUND", "message": "file not found"})
    assert type(rebuilt) is CudaError
    assert (rebuilt.code, rebuilt.name, rebuilt.message) == (301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found")


def test_an_unknown_code_is_a_plain_cuctx_error() -> None:
    rebuilt = error_from_wire({"code": 20000, "name": "FROM_THE_FUTURE", "message": "m"})
    assert type(rebuilt) is CuctxError
    assert (rebuilt.code, rebuilt.name) == (20000, "FROM_THE_FUTURE")
    empty = error_from_wire({})
    assert isinstance(empty, CuctxError)
    assert empty.name == "UNKNOWN"


def test_with_op_tags_once() -> None:
    error = BadOp("m").with_op("first").with_op("second")
    assert error.op == "first"
    assert str(error).startswith("first: CUCTXD_ERROR_BAD_OP (10002)")


@pytest.mark.parametrize("name", ["root\x00/x", "a\tb", "\x1b[2J", "\x85", "\u202e", "zero\u200bwidth", "\ufeff",
                                  "line\u2028", "para\u2029"])
def test_share_names_refuse_control_and_format_characters(name: str) -> None:
    with pytest.raises(BadArgument, match="control or format characters"):
        decode_args(OPS["lookup"], {"name": name})


@pytest.mark.parametrize("name", ["alice/weights", "caf\u00e9 \u00a0no-break", "\u6a21\u578b", "emoji \U0001f600",
                                  "private \ue000"])
def test_share_names_take_other_characters(name: str) -> None:
    assert decode_args(OPS["lookup"], {"name": name}).name == name
