"""Every op in ``protos`` has exactly one handler, in the table of the thread that runs it."""

from __future__ import annotations

import pytest

from cuctxd.daemon.handlers import DEVICE_HANDLERS, FRONT_HANDLERS
from cuctxd.daemon.handlers.registry import device_handler, front_handler
from cuctxd.protos import ops
from cuctxd.protos.schema import OPS


def test_protocol_has_ops() -> None:
    assert {"hello", "goodbye", "ping", "set_device", "alloc", "read", "write", "copy"} <= set(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_exactly_one_handler_in_its_targets_table(name: str) -> None:
    spec = OPS[name]
    tables = {"front": FRONT_HANDLERS, "device": DEVICE_HANDLERS}
    assert name in tables[spec.target], f"{spec.target} op {name!r} has no handler"
    other = "device" if spec.target == "front" else "front"
    assert name not in tables[other], f"{spec.target} op {name!r} also has a {other} handler"


def test_every_handler_serves_an_op() -> None:
    assert set(FRONT_HANDLERS) <= set(OPS)
    assert set(DEVICE_HANDLERS) <= set(OPS)
    assert set(FRONT_HANDLERS) | set(DEVICE_HANDLERS) == set(OPS)


def test_every_device_op_can_name_its_device() -> None:
    """The front routes a device op by its ``device`` argument (else the session's device)."""
    for name, spec in OPS.items():
        if spec.target == "device":
            assert "device" in spec.field_names(), f"device op {name!r} has no 'device' field"


def test_a_second_handler_for_an_op_is_refused() -> None:
    with pytest.raises(ValueError, match="two handlers"):
        device_handler(ops.Alloc)(lambda state, job: None)
    assert DEVICE_HANDLERS["alloc"].__module__ == "cuctxd.daemon.handlers.memory_ops"


def test_a_handler_in_the_wrong_table_is_refused() -> None:
    with pytest.raises(ValueError, match="is a device op"):
        front_handler(ops.Alloc)
    with pytest.raises(ValueError, match="is a front op"):
        device_handler(ops.Ping)
