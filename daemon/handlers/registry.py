"""Op name -> handler, registered explicitly with a decorator per op.

Front handlers run on the front thread: ``(front, session, args, peer) -> Reply | FanOut | Forward | Deferred``
(``peer``: who sent the request, when its frames say; :mod:`cuctxd.daemon.intake.peers`).
Device handlers run on the op's device worker thread:
``(state, job) -> Reply | Pending | Forward``. A test checks that every op in
:data:`cuctxd.protos.schema.OPS` has exactly one handler of the right kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cuctxd.protos.schema import OPS

F = TypeVar("F", bound=Callable[..., Any])

FRONT_HANDLERS: dict[str, Callable[..., Any]] = {}
DEVICE_HANDLERS: dict[str, Callable[..., Any]] = {}


def _register(table: dict[str, Callable[..., Any]], op_type: type, target: str) -> Callable[[F], F]:
    name: str = op_type.op_name  # type: ignore[attr-defined]
    if OPS[name].target != target:
        raise ValueError(f"op {name!r} is a {OPS[name].target} op, not a {target} op")

    def register(fn: F) -> F:
        if name in table:
            raise ValueError(f"op {name!r} has two handlers")
        table[name] = fn
        return fn

    return register


def front_handler(op_type: type) -> Callable[[F], F]:
    return _register(FRONT_HANDLERS, op_type, "front")


def device_handler(op_type: type) -> Callable[[F], F]:
    return _register(DEVICE_HANDLERS, op_type, "device")
