"""How an op's arguments are declared and checked: frozen dataclasses with typed fields.

An op is a frozen dataclass registered with :func:`op`; its fields are its wire
arguments. This one declaration serves both ends: the client builds an instance
(``ops.Alloc(size=..., device=...)``) and sends what :func:`encode_args` makes of it,
under the name :func:`spec_of` gives; the daemon's :func:`decode_args` turns the
decoded msgpack map back into that dataclass or raises
:class:`~cuctxd.protos.errors.BadArgument` naming the field, so nothing loosely typed
travels past the daemon's front door. An unknown argument is an error (a misspelt
``ofset`` must not silently become offset 0); unknown header fields are ignored.

The encoding rule: a field whose value is its declared default (None included, for
optional ones) is left out of the wire map, and the others go in declaration order;
the daemon fills the defaults back in, so ``decode_args(spec, encode_args(x)) == x``.
A default is therefore part of the protocol: changing one changes what an old client
asks for. :func:`op` is a ``dataclass_transform``, so type checkers see each op's
``__init__`` and check the arguments the client passes (the field helpers below take
their ``default`` by keyword so that they can tell).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cuctxd.protos.errors import BadArgument
from cuctxd.protos.limits import MAX_HANDLE

Target = Literal["front", "device"]

T = TypeVar("T")


@dataclass(frozen=True)
class OpSpec:
    """What the protocol says about one op; both daemon and client read it."""

    name: str
    args_type: type
    target: Target
    needs_session: bool
    payload_in: bool
    payload_out: bool
    doc: str

    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.args_type))


OPS: dict[str, OpSpec] = {}


class OpArgs(typing.Protocol):
    """An instance of an op class (what :func:`op` makes), as type checkers see it: any dataclass instance
    passes statically; :func:`spec_of` checks at run time that it is an op's."""

    __dataclass_fields__: typing.ClassVar[dict[str, Any]]


def handle_field(*, default: Any = dataclasses.MISSING) -> Any:
    """A context or buffer handle: a positive 63-bit int; optional with ``default=None``."""
    return dataclasses.field(default=default, metadata={"min": 1, "max": MAX_HANDLE})


#: Unicode categories a name may not hold: controls (NUL, newlines, escapes, C1), format characters (bidi
#: overrides, zero-width ones), surrogates, line and paragraph separators. A name is shown in logs, listings
#: and terminals, and a scoped one is looked up as a user name.
NAME_FORBIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def name_field(max_len: int = 256, *, default: str | Any | None = dataclasses.MISSING) -> Any:
    """A name (a share's): at most ``max_len`` characters, none of them in :data:`NAME_FORBIDDEN`; optional
    with a ``default``."""
    return dataclasses.field(default=default, metadata={"max_len": max_len, "name": True})


def forbidden_in_name(value: str) -> tuple[int, str] | None:
    """The index and character of the first character a name may not hold, or None."""
    if value.isprintable():  # the common case: no character of those categories (nor any other non-printable)
        return None
    for index, char in enumerate(value):
        if unicodedata.category(char) in NAME_FORBIDDEN:
            return index, char
    return None


def count_field(*, default: int | None, minimum: int = 0, maximum: int = MAX_HANDLE) -> Any:
    """A non-negative size, offset or index, optional: ``default`` (keyword, so that type checkers see it)."""
    return dataclasses.field(default=default, metadata={"min": minimum, "max": maximum})


def required_count(*, minimum: int = 0) -> Any:
    """A non-negative size, offset or index the op cannot do without."""
    return dataclasses.field(metadata={"min": minimum, "max": MAX_HANDLE})


@typing.dataclass_transform(
    frozen_default=True, field_specifiers=(dataclasses.field, handle_field, name_field, count_field, required_count))
def op(
    name: str,
    *,
    target: Target,
    session: bool = True,
    payload_in: bool = False,
    payload_out: bool = False,
) -> typing.Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as the argument shape of op ``name``."""

    def register(cls: type[T]) -> type[T]:
        if name in OPS:
            raise ValueError(f"op {name!r} registered twice")
        frozen = dataclass(frozen=True)(cls)
        frozen.op_name = name  # type: ignore[attr-defined]
        OPS[name] = OpSpec(
            name=name,
            args_type=frozen,
            target=target,
            needs_session=session,
            payload_in=payload_in,
            payload_out=payload_out,
            doc=(cls.__doc__ or "").strip(),
        )
        return frozen

    return register


def _check_scalar(name: str, value: Any, expected: type, meta: typing.Mapping[str, Any]) -> Any:
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadArgument(f"argument {name!r} must be an integer, got {type(value).__name__}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and value < lo:
            raise BadArgument(f"argument {name!r} must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise BadArgument(f"argument {name!r} must be <= {hi}, got {value}")
        return value
    if expected is bool:
        if not isinstance(value, bool):
            raise BadArgument(f"argument {name!r} must be a boolean, got {type(value).__name__}")
        return value
    if expected is str:
        if not isinstance(value, str):
            raise BadArgument(f"argument {name!r} must be a string, got {type(value).__name__}")
        if len(value) > meta.get("max_len", 4096):
            raise BadArgument(f"argument {name!r} is longer than {meta.get('max_len', 4096)} characters")
        if meta.get("name") and (found := forbidden_in_name(value)) is not None:
            index, char = found
            raise BadArgument(f"argument {name!r} may not hold control or format characters: U+{ord(char):04X} "
                              f"({unicodedata.name(char, unicodedata.category(char))}) at index {index}")
        return value
    if expected is bytes:
        if not isinstance(value, bytes):
            raise BadArgument(f"argument {name!r} must be binary, got {type(value).__name__}")
        return value
    raise TypeError(f"unsupported argument type {expected!r} for {name!r}")


def _unwrap_optional(hint: Any) -> tuple[type, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return members[0], True
    return hint, False


@dataclass(frozen=True)
class _Arg:
    name: str
    type: type
    optional: bool
    has_default: bool
    meta: typing.Mapping[str, Any]
    #: For int arguments, the accepted range (0 to -1, accepting nothing, for other types): the common
    #: case, an int in range, is checked inline in :func:`decode_args`.
    lo: int = 0
    hi: int = -1


@functools.cache
def _args_of(args_type: type) -> tuple[tuple[_Arg, ...], frozenset[str]]:
    """Resolve an op's field types once (``get_type_hints`` is far too slow per request)."""
    hints = typing.get_type_hints(args_type)
    args = []
    for f in dataclasses.fields(args_type):
        expected, optional = _unwrap_optional(hints[f.name])
        lo, hi = 0, -1
        if expected is int:
            lo, hi = f.metadata.get("min", -(1 << 64)), f.metadata.get("max", 1 << 64)
        args.append(_Arg(f.name, expected, optional, f.default is not dataclasses.MISSING, f.metadata, lo, hi))
    return tuple(args), frozenset(a.name for a in args)


@functools.cache
def _defaults_of(args_type: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(args_type) if f.default is not dataclasses.MISSING}


def _build(args_type: type, values: dict[str, Any]) -> Any:
    """The op dataclass holding ``values`` (checked, every field present), without running its
    ``__init__``: a frozen dataclass sets each field through ``object.__setattr__``, which was the
    largest part of decoding a request's arguments."""
    instance: Any = object.__new__(args_type)
    instance.__dict__.update(values)
    return instance


@functools.cache
def _no_args(args_type: type) -> Any:
    """The one instance of an argument-less op (frozen, so it can be shared)."""
    return args_type()


def decode_args(spec: OpSpec, raw: Any) -> Any:
    """Check ``raw`` (the request's ``args``) against ``spec`` and build its dataclass."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadArgument(f"'args' of {spec.name} must be a map, got {type(raw).__name__}")
    args, names = _args_of(spec.args_type)
    if not raw and not args:
        return _no_args(spec.args_type)
    if not names.issuperset(raw):
        unknown = ", ".join(sorted(repr(k) for k in raw if k not in names)[:5])
        raise BadArgument(f"{spec.name} has no argument(s) {unknown}")
    values = dict(_defaults_of(spec.args_type))
    for arg in args:
        value = raw.get(arg.name)
        if value is None:
            if arg.name in raw and arg.optional:
                values[arg.name] = None
            elif not arg.has_default:
                raise BadArgument(f"{spec.name} needs argument {arg.name!r}")
            continue
        if type(value) is int and arg.lo <= value <= arg.hi:  # bool is not int here: it takes the long way
            values[arg.name] = value
        else:
            values[arg.name] = _check_scalar(arg.name, value, arg.type, arg.meta)
    return _build(spec.args_type, values)


@functools.cache
def _wire_fields(args_type: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and default (``dataclasses.MISSING`` for a required one), in declaration order."""
    return tuple((f.name, f.default) for f in dataclasses.fields(args_type))


def encode_args(args: OpArgs) -> dict[str, Any]:
    """The wire ``args`` map of an op instance: its fields in declaration order, leaving out each one whose
    value is its default (None included); :func:`decode_args` gives back an equal instance."""
    args_type: type = type(args)
    values = args.__dict__
    return {name: value for name, default in _wire_fields(args_type)
            if not ((value := values[name]) is default or (type(value) is type(default) and value == default))}


def spec_of(args: OpArgs) -> OpSpec:
    """The spec of an op instance; TypeError for anything else (an op name, a map of arguments)."""
    spec = OPS.get(getattr(type(args), "op_name", ""))
    if spec is None or type(args) is not spec.args_type:
        raise TypeError(f"expected an instance of an op class (cuctxd.protos.ops and its siblings), "
                        f"got {type(args).__name__}")
    return spec
