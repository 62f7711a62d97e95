"""Hypothesis strategies for the reliability fuzz, and the oracle that says what each input must get.

The strategies draw *abstract* requests (:class:`RequestPlan`): "the session's
own buffer number 3", "the bystander's context", "a float where an int is
due". ``test_fuzz`` resolves them against the live daemon, so the generated
data never holds the random handles the daemon hands out and every run draws
the same inputs. :func:`expect` is the oracle: from the header actually sent
it works out, following the check order of PROTOCOL.md section 6, the reply id
and the envelope error the daemon must give, or that the request reaches the op.

Every input sent is counted in :data:`INPUTS`; the conftest prints the counts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import ErrorCode
from cuctxd.protos.limits import MAX_HANDLE, MAX_HEADER_BYTES, MAX_LISTED
from cuctxd.protos.schema import OPS, OpSpec

#: Inputs sent to a daemon, by kind; printed at the end of the run (conftest).
INPUTS: Counter[str] = Counter()

INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1
#: Size of the buffers a fuzz session starts with; offsets and sizes are drawn around it.
BUFFER_SIZE = 4096
INTERNAL = ErrorCode.CUCTXD_ERROR_INTERNAL.name


def soak_mode() -> bool:
    """True for the long soak (``CUCTXD_SOAK=1`` or ``--soak``); read at test time, not import time."""
    return os.environ.get("CUCTXD_SOAK", "") not in ("", "0")


def scaled(ci_count: int) -> int:
    """``ci_count`` in CI; ``CUCTXD_SOAK_FACTOR`` (default 50) times as many in the soak."""
    return ci_count * int(os.environ.get("CUCTXD_SOAK_FACTOR", "50")) if soak_mode() else ci_count


def fuzz_settings(ci_examples: int) -> settings:
    """Deterministic in CI (derandomized, no example database, the first bug only, so that shrinking stays
    short); random, reproducible by blob and reporting every distinct bug in the soak."""
    soak = soak_mode()
    return settings(max_examples=scaled(ci_examples), deadline=None, derandomize=not soak, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=soak, report_multiple_bugs=soak)


# --- plain msgpack values and garbage frames -----------------------------------------------------

packable_ints = st.integers(INT64_MIN, UINT64_MAX)
edge_ints = st.sampled_from([0, 1, -1, 255, 256, 4095, 4096, 4097, 0xFFFF_FFFF, 1 << 32, (1 << 53) - 1,
                             1 << 53, 1 << 62, MAX_HANDLE, MAX_HANDLE + 1, UINT64_MAX, INT64_MIN])
scalars = st.one_of(st.none(), st.booleans(), packable_ints, edge_ints, st.floats(), st.text(max_size=12),
                    st.binary(max_size=12))
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=8), packable_ints), inner, max_size=4)),
    max_leaves=10,
)


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


_BOMBS = [
    b"\xdd\xff\xff\xff\xff",          # array32 of 2**32-1 elements, none present
    b"\xdf\xff\xff\xff\xff",          # map32 likewise
    b"\xdb\xff\xff\xff\xff" + b"a",   # str32 of 4 GiB with one byte
    b"\xc6\xff\xff\xff\xff",          # bin32
    b"\xc9\xff\xff\xff\xff\x01",      # ext32
    b"\xa2\xff\xfe",                  # str with invalid UTF-8
    b"\x81\xa2\xc3\x28\x01",          # map whose key is invalid UTF-8
    b"\xc1",                          # the one byte msgpack never uses
    b"\x81\xa2id\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # {"id": 2**64-1}
]


def _nested(depth: int, map_form: bool) -> bytes:
    return (b"\x81\xa1k" * depth if map_form else b"\x91" * depth) + b"\xc0"


#: The ops the fuzz sends: all but those that end another session or the daemon (the fuzz runs as the daemon's
#: uid, which may close the bystander's session or stop the daemon; who else may is tested in
#: tests/integration/test_first_contact_cli.py).
#: Nor ``wait_version``, which waits by design (up to its ``timeout_ms``, an hour when omitted) where the fuzz wants
#: every reply within REPLY_DEADLINE; its waits are tested in tests/integration/test_versions.py.
FUZZED_OPS = sorted(set(OPS) - {"close_session", "shutdown", "wait_version"})

header_like = st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.integers(1, 999), edge_ints, scalars),
    "op": st.one_of(st.sampled_from(FUZZED_OPS), st.sampled_from(FUZZED_OPS), scalars),
    "session": st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32), scalars),
    "args": st.one_of(st.none(), msgpack_values,
                      st.dictionaries(st.sampled_from(["size", "buffer", "device", "protocol", "value", "stream",
                                                       "context", "name", "offset"]), scalars, max_size=3)),
    "extra": msgpack_values,
})

garbage_headers = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=200, max_size=4000),
    msgpack_values.map(pack),
    header_like.map(pack),
    st.tuples(header_like.map(pack), st.integers(1, 8)).map(lambda t: t[0][:-t[1]] if len(t[0]) > t[1] else b""),
    st.tuples(header_like.map(pack), st.binary(min_size=1, max_size=8)).map(lambda t: t[0] + t[1]),
    st.tuples(st.integers(1, 3000), st.booleans()).map(lambda t: _nested(*t)),
    st.sampled_from(_BOMBS),
)
payload_junk = st.one_of(st.binary(max_size=64), st.integers(0, 70_000).map(lambda n: bytes([n % 251]) * n))


# --- the ops' arguments, read from cuctxd.protos.schema -------------------------------------------------

_ROLE_BY_NAME = {
    "buffer": "buffer", "src": "buffer", "dst": "buffer", "context": "context", "stream": "stream",
    "event": "event", "start": "event", "end": "event", "device": "device", "dst_device": "device",
    "share_id": "share_id", "name": "share_name", "value": "byte", "flags": "flags", "protocol": "protocol",
    "client": "text", "pid": "count", "offset": "extent", "size": "extent", "src_offset": "extent",
    "dst_offset": "extent", "after": "share_name", "prefix": "name_prefix", "limit": "page_limit",
    "owner": "session_number", "uid": "uid",
}
#: Argument names that carry a handle, by the kind of object they name.
HANDLE_ROLES = ("buffer", "context", "stream", "event")


@dataclass(frozen=True)
class Arg:
    """One argument of an op as the spec declares it (type, default, range)."""

    name: str
    kind: type
    required: bool
    lo: int | None
    hi: int | None
    max_len: int
    role: str
    #: A share name: control, format, surrogate and line/paragraph separator characters are refused (PROTOCOL.md).
    is_name: bool = False


@dataclass(frozen=True)
class OpArgs:
    spec: OpSpec
    args: tuple[Arg, ...]

    def named(self, name: str) -> Arg | None:
        return next((a for a in self.args if a.name == name), None)


def _unwrap(hint: Any) -> type:
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    return members[0] if members else hint  # type: ignore[no-any-return]


def op_args(spec: OpSpec) -> OpArgs:
    hints = typing.get_type_hints(spec.args_type)
    args = []
    for f in dataclasses.fields(spec.args_type):
        kind = _unwrap(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        role = _ROLE_BY_NAME.get(f.name, {bool: "bool", str: "text", bytes: "blob"}.get(kind, "count"))
        if spec.name == "alloc" and f.name == "size":
            role = "alloc_size"
        args.append(Arg(f.name, kind, required, f.metadata.get("min"), f.metadata.get("max"),
                        f.metadata.get("max_len", 4096), role, bool(f.metadata.get("name"))))
    return OpArgs(spec, tuple(args))


OP_ARGS: dict[str, OpArgs] = {name: op_args(spec) for name, spec in OPS.items()}
ALL_ARG_NAMES = sorted({a.name for o in OP_ARGS.values() for a in o.args})


# --- abstract requests -----------------------------------------------------------------------------

_VALID: dict[str, st.SearchStrategy[Any]] = {
    "device": st.one_of(*[st.just(("match",))] * 4, st.tuples(st.just("dev"), st.sampled_from([0, 1])),
                        st.tuples(st.just("dev"), st.one_of(st.integers(2, 5), st.just(MAX_HANDLE)))),
    "extent": st.one_of(st.sampled_from([0, 1, 16, BUFFER_SIZE - 1, BUFFER_SIZE, BUFFER_SIZE + 1, 1 << 62,
                                         MAX_HANDLE]), st.integers(0, 2 * BUFFER_SIZE)),
    "alloc_size": st.one_of(st.integers(1, 2 * BUFFER_SIZE),
                            st.sampled_from([0, 1 << 20, 8 << 20, 65 << 20, 1 << 30, 1 << 62, MAX_HANDLE])),
    "byte": st.integers(0, 255),
    "flags": st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 0x10, 0xFF, 0x100, 0xFFFF_FFFF]),
                       st.integers(0, 0xFFFF_FFFF)),
    "protocol": st.sampled_from([1, 1, 0, 2, MAX_HANDLE]),
    "text": st.text(max_size=16),
    "count": st.one_of(st.integers(0, 1 << 20), st.just(MAX_HANDLE)),
    "bool": st.booleans(),
    "blob": st.binary(max_size=72),
    "share_id": st.one_of(st.tuples(st.just("own_share"), st.integers(0, 3)), st.just(("foreign_share",)),
                          st.tuples(st.just("text"), st.text(max_size=40))),
    "share_name": st.one_of(st.tuples(st.just("own_name"), st.integers(0, 3)), st.just(("foreign_name",)),
                            st.tuples(st.just("text"), st.sampled_from(["fz-0", "fz-1", "fz-2", ""])),
                            st.tuples(st.just("text"), st.text(max_size=20))),
    "name_prefix": st.one_of(st.sampled_from(["", "fz-", "bystander", "crowd-", "crowd-0", "crowd-1", "zz"]),
                             st.text(max_size=8)),
    "page_limit": st.one_of(st.integers(1, MAX_LISTED), st.sampled_from([1, 2, MAX_LISTED])),
    "session_number": st.one_of(st.integers(0, 64), st.just(MAX_HANDLE)),
    "uid": st.one_of(st.sampled_from([os.getuid(), 0, 65534]), st.integers(0, 0xFFFF_FFFF)),
}
for _role in HANDLE_ROLES:
    _VALID[_role] = st.one_of(
        *[st.tuples(st.just("own"), st.integers(0, 7))] * 4,
        st.tuples(st.just("foreign"), st.integers(0, 7)),
        st.tuples(st.just("random"), st.one_of(st.integers(1, MAX_HANDLE), st.sampled_from([1, 2, 3, MAX_HANDLE])))
    )


def _wrong_type(arg: Arg) -> st.SearchStrategy[Any]:
    if arg.kind is int:
        return st.one_of(st.floats(), st.booleans(), st.text(max_size=6), st.binary(max_size=6),
                         st.lists(st.integers(0, 9), max_size=2), st.dictionaries(st.text(max_size=3), st.none(),
                                                                                   max_size=1))
    if arg.kind is bool:
        return st.one_of(st.integers(0, 1), st.text(max_size=5), st.floats(), st.binary(max_size=2))
    if arg.kind is bytes:
        return st.one_of(packable_ints, st.text(max_size=8), st.booleans(), st.lists(st.text(max_size=3), max_size=2))
    return st.one_of(packable_ints, st.binary(max_size=8), st.booleans(), st.lists(st.text(max_size=3), max_size=2))


def _out_of_range(arg: Arg) -> st.SearchStrategy[Any]:
    if arg.kind is str:
        return st.integers(arg.max_len + 1, arg.max_len + 3).map(lambda n: "x" * n)
    if arg.kind is not int:
        return _wrong_type(arg)
    parts = []
    if arg.lo is not None and arg.lo > INT64_MIN:
        parts.append(st.one_of(st.integers(INT64_MIN, arg.lo - 1), st.just(arg.lo - 1)))
    if arg.hi is not None and arg.hi < UINT64_MAX:
        parts.append(st.one_of(st.integers(arg.hi + 1, UINT64_MAX), st.just(arg.hi + 1)))
    return st.one_of(*parts) if parts else _wrong_type(arg)


def arg_choice(arg: Arg, mutated: bool) -> st.SearchStrategy[tuple[Any, ...]]:
    """A valid value (or, for an optional argument, often none); mutated: absent, nil, mistyped or out of range."""
    if mutated:
        broken = [_wrong_type(arg).map(lambda v: ("raw", v)), _out_of_range(arg).map(lambda v: ("raw", v))]
        if arg.required:
            broken += [st.just(("omit",)), st.just(("nil",))]
        return st.one_of(*broken)
    valid = _VALID[arg.role].map(lambda v: ("valid", v))
    if arg.required:
        return valid
    absent = st.just(("omit",))
    return st.one_of(valid, valid, absent, absent, absent, st.just(("nil",))) if arg.role in HANDLE_ROLES \
        else st.one_of(valid, valid, absent, st.just(("nil",)))


@dataclass(frozen=True)
class RequestPlan:
    """An abstract request: what to put in each header field, resolved by the harness."""

    op: Any                      # an op name, or ("raw", value) / ("absent",)
    id: tuple[Any, ...]          # ("fresh",), ("raw", value), ("absent",)
    session: tuple[Any, ...]     # ("own",), ("absent",), ("nil",), ("hex", text), ("raw", value)
    args: tuple[Any, ...]        # ("map", {name: choice}, extras), ("absent",), ("nil",), ("raw", value)
    frames: tuple[Any, ...]      # ("expected" | n, [sizes])
    args_op: str                 # the op whose arguments ``args`` was drawn for


_bad_ids = st.one_of(st.just(("absent",)), st.sampled_from([0, 7, MAX_HANDLE, -1, MAX_HANDLE + 1, True, 1.5, "12",
                                                            None, b"\x01", [1]]).map(lambda v: ("raw", v)))
_bad_sessions = st.one_of(st.just(("absent",)), st.just(("nil",)),
                          st.text("0123456789abcdef", min_size=32, max_size=32).map(lambda s: ("hex", s)),
                          st.one_of(st.text(max_size=40), packable_ints, st.binary(max_size=16), st.booleans())
                          .map(lambda v: ("raw", v)))
_sizes = st.one_of(st.integers(0, 2 * BUFFER_SIZE), st.sampled_from(["max", 0, 1]))
_frame_sizes = st.lists(_sizes, min_size=3, max_size=3)
_bad_frame_sizes = st.lists(st.one_of(_sizes, st.just("max+1")), min_size=3, max_size=3)
_extra_keys = st.one_of(st.text(max_size=8).filter(lambda k: k not in ALL_ARG_NAMES), st.sampled_from(ALL_ARG_NAMES),
                        packable_ints)
_extras = st.lists(st.tuples(_extra_keys, scalars), min_size=1, max_size=2).map(tuple)
_bad_args = st.one_of(st.just(("absent",)), st.just(("nil",)),
                      msgpack_values.filter(lambda v: not isinstance(v, dict) and v is not None)
                      .map(lambda v: ("raw", v)))
_junk_ops = st.one_of(st.text(max_size=12).filter(lambda s: s not in OPS).map(lambda s: ("raw", s)),
                      scalars.filter(lambda v: not isinstance(v, str)).map(lambda v: ("raw", v)),
                      st.just(("absent",)))
_ENVELOPE = ("id", "session", "frames", "args", "extras")


@functools.cache
def _parts(name: str) -> tuple[st.SearchStrategy[frozenset[str]], dict[tuple[str, bool], st.SearchStrategy[Any]]]:
    """Per op, built once: which parts to mutate, and each argument's valid and mutated choices."""
    targets = [a.name for a in OP_ARGS[name].args] + list(_ENVELOPE)
    mutated = st.one_of(*[st.just(frozenset())] * 5, st.sets(st.sampled_from(targets), min_size=1, max_size=1),
                        st.sets(st.sampled_from(targets), min_size=1, max_size=3))
    choices = {(a.name, broken): arg_choice(a, broken) for a in OP_ARGS[name].args for broken in (False, True)}
    return mutated, choices


@st.composite
def _plan(draw: st.DrawFn, name: str, junk: bool) -> RequestPlan:
    """A valid request of op ``name`` with none, one or a few of its parts mutated."""
    mutation, arg_choices = _parts(name)
    mutated = draw(mutation)
    choices = {a.name: draw(arg_choices[a.name, a.name in mutated]) for a in OP_ARGS[name].args}
    if "args" in mutated:
        args: tuple[Any, ...] = draw(_bad_args)
    else:
        args = ("map", choices, draw(_extras) if "extras" in mutated else ())
    count = draw(st.integers(0, 3)) if "frames" in mutated else "expected"
    sizes = draw(_bad_frame_sizes if "frames" in mutated else _frame_sizes)
    return RequestPlan(
        op=draw(_junk_ops) if junk else name,
        id=draw(_bad_ids) if "id" in mutated else ("fresh",),
        session=draw(_bad_sessions) if "session" in mutated else ("own",),
        args=args, frames=(count, sizes), args_op=name,
    )


_named_plans = st.sampled_from(FUZZED_OPS).flatmap(lambda name: _plan(name, False))
_junk_plans = st.sampled_from(FUZZED_OPS).flatmap(lambda name: _plan(name, True))
request_plans = st.one_of(*[_named_plans] * 15, _junk_plans)
#: Ops whose cost could grow with the number of published names, sessions and shares (issue 41, item 2).
REGISTRY_OPS = ("list_shared", "list_shared", "list_shared", "lookup", "unpublish", "status", "publish")
registry_plans = st.sampled_from(REGISTRY_OPS).flatmap(lambda name: _plan(name, False))


# --- the oracle -----------------------------------------------------------------------------------


@dataclass
class World:
    """What the oracle must know about the daemon: live tokens and their current devices."""

    device_count: int
    max_payload: int
    current_device: dict[str, int] = field(default_factory=dict)  # live token -> current device


@dataclass(frozen=True)
class Expected:
    """``error``: the envelope error the request must get, or None when it reaches its op."""

    reply_id: int
    error: str | None
    spec: OpSpec | None = None
    session: str | None = None
    device: int | None = None
    args: Mapping[Any, Any] | None = None


def valid_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_HANDLE


def decode(frame: bytes) -> tuple[bool, Any]:
    """(decodable, value), decoding as PROTOCOL.md section 2 says (one value, UTF-8 strings, any keys)."""
    try:
        return True, msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return False, None


def expect_frames(frames: Sequence[bytes], world: World) -> Expected:
    """The expectation for a raw multipart message (header frame first)."""
    header = frames[0]
    if len(header) > MAX_HEADER_BYTES:
        return Expected(0, ErrorCode.CUCTXD_ERROR_TOO_LARGE.name)
    ok, value = decode(header)
    if not ok:
        return Expected(0, ErrorCode.CUCTXD_ERROR_BAD_REQUEST.name)
    return expect(value, [len(f) for f in frames[1:]], world)


def _arg_ok(arg: Arg, value: Any) -> bool:
    if arg.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return (arg.lo is None or value >= arg.lo) and (arg.hi is None or value <= arg.hi)
    if arg.kind is bool:
        return isinstance(value, bool)
    if arg.kind is bytes:
        return isinstance(value, bytes)
    if not isinstance(value, str) or len(value) > arg.max_len:
        return False
    return not (arg.is_name and any(unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp") for char in value))


def args_rejected(op: OpArgs, raw: Any) -> bool:
    """Whether ``raw`` fails the argument checks (BAD_ARGUMENT)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return True
    names = {a.name for a in op.args}
    if any(not isinstance(key, str) or key not in names for key in raw):
        return True
    for arg in op.args:
        value = raw.get(arg.name)
        if value is None:
            if arg.required:
                return True
        elif not _arg_ok(arg, value):
            return True
    return False


def expect(header: Any, payload_sizes: Sequence[int], world: World) -> Expected:
    """Walk the envelope checks of PROTOCOL.md section 6 in order; the first that fails is the answer."""
    bad_request = ErrorCode.CUCTXD_ERROR_BAD_REQUEST.name
    if not isinstance(header, dict):
        return Expected(0, bad_request)
    rid = header.get("id")
    if not valid_id(rid):
        return Expected(0, bad_request)
    name = header.get("op")
    if not isinstance(name, str):
        return Expected(rid, bad_request)
    spec = OPS.get(name)
    if spec is None:
        return Expected(rid, ErrorCode.CUCTXD_ERROR_BAD_OP.name)
    token = header.get("session")
    if token is not None and not isinstance(token, str):
        return Expected(rid, bad_request)
    if spec.needs_session and token not in world.current_device:
        return Expected(rid, ErrorCode.CUCTXD_ERROR_UNKNOWN_SESSION.name)
    if len(payload_sizes) != (1 if spec.payload_in else 0):
        return Expected(rid, bad_request)
    if any(size > world.max_payload for size in payload_sizes):
        return Expected(rid, ErrorCode.CUCTXD_ERROR_TOO_LARGE.name)
    raw = header.get("args")
    if args_rejected(OP_ARGS[name], raw):
        return Expected(rid, ErrorCode.CUCTXD_ERROR_BAD_ARGUMENT.name)
    args = raw or {}
    device = None
    if spec.target == "device":
        assert token is not None
        device = args.get("device")
        device = world.current_device[token] if device is None else device
        dst = args.get("dst_device")
        if device >= world.device_count or (dst is not None and dst >= world.device_count):
            return Expected(rid, CUresult.CUDA_ERROR_INVALID_DEVICE.name)
    return Expected(rid, None, spec, token, device, args)


def _cuda_name(code: int) -> str | None:
    try:
        return CUresult(code).name
    except ValueError:  # a result cuctxd does not list: forwarded from the driver as is
        return None


def shape_problem(header: Any, frames: Sequence[bytes], expected: Expected) -> str | None:
    """What is wrong with a reply's shape (PROTOCOL.md section 3 and 6), or None."""
    if not isinstance(header, dict) or "id" not in header or "ok" not in header:
        return f"reply header is not a reply: {header!r}"
    if header["id"] != expected.reply_id or isinstance(header["id"], bool):
        return f"reply id {header['id']!r}, expected {expected.reply_id}"
    if header["ok"] is True:
        if not isinstance(header.get("result"), dict) or "error" in header:
            return f"a success must carry a result map and no error: {header!r}"
        return None
    if header["ok"] is not False:
        return f"'ok' must be a bool: {header!r}"
    error = header.get("error")
    if "result" in header or not isinstance(error, dict) or set(error) != {"code", "name", "message"}:
        return f"a failure must carry exactly an error map {{code, name, message}}: {header!r}"
    code, name, message = error["code"], error["name"], error["message"]
    if not isinstance(code, int) or not isinstance(name, str) or not isinstance(message, str):
        return f"error fields have the wrong types: {error!r}"
    if code >= 10000:
        known = {int(c): c.name for c in ErrorCode}
        if known.get(code) != name:
            return f"cuctxd code {code} does not match name {name!r}"
    elif code < 1 or not name.startswith("CUDA_ERROR_") or _cuda_name(code) not in (None, name):
        return f"CUDA code {code} does not match name {name!r}"
    if name == INTERNAL:
        return f"the daemon reported an internal error (a daemon bug): {message}"
    if "Traceback" in message:
        return f"a traceback leaked into an error message: {message}"
    if frames:
        return f"an error reply carries {len(frames)} payload frame(s)"
    return None
