"""How client objects present themselves: reprs with handles in hex, and the async twins' docstrings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

ClassT = TypeVar("ClassT", bound=type)

#: Record fields that hold a session-scoped handle: shown in hex, as the daemon's error messages show them.
HANDLE_FIELDS = frozenset({"handle", "context"})


def docs_from(twin: type) -> Callable[[ClassT], ClassT]:
    """Give an async class's undocumented methods the docstrings of its sync twin's namesakes."""

    def borrow(cls: ClassT) -> ClassT:
        for name, member in vars(cls).items():
            source = getattr(twin, name, None)
            if callable(member) and member.__doc__ is None and source is not None:
                member.__doc__ = source.__doc__
        return cls

    return borrow


def describe(kind: str, fields: dict[str, Any]) -> str:
    """``Kind(handle=0x1f, device=0, ...)``: handles in hex, like the daemon's messages."""
    shown = ", ".join(f"{name}={value:#x}" if name in HANDLE_FIELDS else f"{name}={value!r}"
                      for name, value in fields.items())
    return f"{kind}({shown})"
