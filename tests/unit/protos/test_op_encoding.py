"""protos.schema's encoding of an op instance (what the client sends) against its decoding (what the daemon
reads): for every op in OPS, one declaration both ways."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from cuctxd.protos import ops, schema, sharing_ops
from cuctxd.protos.schema import OPS, OpSpec, decode_args, encode_args, spec_of


def _example(field: dataclasses.Field[Any], hint: Any) -> Any:
    """A value the field accepts that is not its default."""
    expected = typing.get_args(hint)[0] if typing.get_args(hint) else hint
    default = field.default
    if expected is bool:
        return default is not True
    if expected is int:
        low = max(field.metadata.get("min", 0), 1)
        return low + 1 if low + 1 != default and low + 1 <= field.metadata.get("max", low + 1) else low
    if expected is str:
        return "example-name"
    if expected is bytes:
        return b"\x01\x02"
    raise AssertionError(f"no example for {field.name}: {hint!r}")


def _examples(spec: OpSpec) -> dict[str, Any]:
    hints = typing.get_type_hints(spec.args_type)
    return {f.name: _example(f, hints[f.name]) for f in dataclasses.fields(spec.args_type)}


def _required(spec: OpSpec) -> dict[str, Any]:
    every = _examples(spec)
    return {f.name: every[f.name] for f in dataclasses.fields(spec.args_type)
            if f.default is dataclasses.MISSING}


@pytest.mark.parametrize("spec", list(OPS.values()), ids=list(OPS))
def test_every_op_is_constructible_and_encodes_back_to_what_it_decodes(spec: OpSpec) -> None:
    full = spec.args_type(**_examples(spec))
    wire = encode_args(full)
    assert wire == _examples(spec)  # no field at its default: every one travels
    assert decode_args(spec, wire) == full
    assert encode_args(decode_args(spec, wire)) == wire
    assert spec_of(full) is spec


@pytest.mark.parametrize("spec", list(OPS.values()), ids=list(OPS))
def test_fields_at_their_default_stay_off_the_wire(spec: OpSpec) -> None:
    required = _required(spec)
    bare = spec.args_type(**required)
    assert encode_args(bare) == required
    assert decode_args(spec, encode_args(bare)) == bare


def test_wire_args_follow_the_declaration_order_and_leave_out_defaults() -> None:
    assert encode_args(ops.Alloc(size=8, device=0, shareable=False)) == {"size": 8, "device": 0}
    assert list(encode_args(ops.Fill(buffer=3, value=7, offset=0, device=1, stream=9))) == [
        "buffer", "value", "device", "stream"]
    assert encode_args(sharing_ops.ListShared(limit=10, prefix="")) == {"limit": 10}


def test_a_value_equal_to_the_default_but_of_another_type_still_travels() -> None:
    """Only a value of the default's own type is left out: the daemon, not the client, judges the rest."""
    odd = ops.CreateContext(flags=False)  # type: ignore[arg-type]
    assert encode_args(odd) == {"flags": False}


@pytest.mark.parametrize("thing", ["alloc", {"size": 8}, None, dataclasses.make_dataclass("Alloc", ["size"])(8)])
def test_spec_of_refuses_what_is_not_an_op_instance(thing: Any) -> None:
    with pytest.raises(TypeError, match="op class"):
        spec_of(thing)


def test_type_checkers_see_the_op_classes_as_dataclasses_with_every_field_helper() -> None:
    """``op`` is a ``dataclass_transform`` naming each field helper, so mypy checks the client's op arguments
    (a helper left out would make its fields look required, or their defaults unknown)."""
    transform = schema.op.__dataclass_transform__  # type: ignore[attr-defined]
    helpers = {schema.handle_field, schema.name_field, schema.count_field, schema.required_count, dataclasses.field}
    assert set(transform["field_specifiers"]) == helpers
