"""Every request the client makes is built from an op class of cuctxd.protos (the one declaration the daemon
decodes with), never from an op name or a map of arguments."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cuctxd import client
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Request
from cuctxd.protos import ops
from cuctxd.protos.schema import OPS

CLIENT = Path(client.__file__).resolve().parent
OP_MODULES = ("ops", "pinned_ops", "sharing_ops", "stream_ops", "system_ops")
#: The calls through which a request leaves: an op name among their arguments is a request made by name.
SENDERS = {"Request", "send", "try_send", "call", "encode_request"}


def _nothing(result: dict[str, Any], frames: list[Any]) -> None:
    return None


def test_a_request_takes_its_wire_name_and_args_from_the_op_instance() -> None:
    request = Request(ops.Read(buffer=4, size=16, device=1), _nothing)
    assert (request.op, request.args) == ("read", {"buffer": 4, "size": 16, "device": 1})
    assert build.alloc(None, _Built, 64, 0, False).args == {"size": 64, "device": 0}


class _Built:
    @staticmethod
    def from_wire(owner: Any, wire: dict[str, Any]) -> Any:
        return wire


@pytest.mark.parametrize("made_from", ["alloc", {"size": 64}, ("alloc", {"size": 64})])
def test_a_request_made_from_an_op_name_or_a_map_is_refused(made_from: Any) -> None:
    with pytest.raises(TypeError, match="op class"):
        Request(made_from, _nothing)


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(CLIENT.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _called(node: ast.Call) -> str | None:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)


def test_no_client_module_sends_an_op_by_its_name() -> None:
    by_name = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called(node) in SENDERS:
                values = [*node.args, *(k.value for k in node.keywords)]
                by_name += [f"{path.relative_to(CLIENT)}:{node.lineno}: {value.value!r}" for value in values
                            if isinstance(value, ast.Constant) and value.value in OPS]
    assert not by_name, "requests made from an op name instead of an op class:\n" + "\n".join(by_name)


def test_every_op_class_the_client_builds_is_an_op_the_daemon_decodes() -> None:
    declared = {spec.args_type for spec in OPS.values()}
    built = set()
    for path, tree in _modules():
        aliases = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module == "cuctxd.protos"
                   for alias in node.names if alias.name in OP_MODULES}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases):
                module = __import__(f"cuctxd.protos.{aliases[node.func.value.id]}", fromlist=["_"])
                made = getattr(module, node.func.attr)
                assert made in declared, f"{path.relative_to(CLIENT)}:{node.lineno}: {made!r} is not in OPS"
                built.add(made.op_name)
    assert {"hello", "alloc", "read", "publish", "stream_ordered", "memcpy_htod"} <= built
