"""client/ARCHITECTURE.md matches the tree: every module or package it names exists, every subpackage is named,
and the layers it states are the import contract's."""

from __future__ import annotations

import re
import tomllib

from tests.helpers import REPO

CLIENT = REPO / "client"
DOC = CLIENT / "ARCHITECTURE.md"
#: A path relative to client/ in backticks: `wire/`, `api/client.py`, `__main__.py`.
NAMED = re.compile(r"`((?:[a-z_]+/)*(?:[a-z_]+\.py|[a-z_]+/))`")


def named_paths() -> set[str]:
    return set(NAMED.findall(DOC.read_text()))


def test_the_doc_names_modules_and_packages() -> None:
    names = named_paths()
    assert "api/client.py" in names and "wire/" in names  # the pattern reads the doc as written


def test_every_named_module_and_package_exists() -> None:
    missing = sorted(name for name in named_paths()
                     if not (CLIENT / name).is_file() and not (CLIENT / name / "__init__.py").is_file())
    assert missing == []


def test_every_subpackage_and_module_is_named() -> None:
    in_tree = {f"{init.parent.relative_to(CLIENT).as_posix()}/" for init in CLIENT.rglob("__init__.py")
               if init.parent != CLIENT}
    in_tree |= {module.relative_to(CLIENT).as_posix() for module in CLIENT.rglob("*.py")
                if module.name != "__init__.py"}
    assert len(in_tree) > 30
    assert sorted(in_tree - named_paths()) == []


def test_the_top_level_stays_small() -> None:
    assert len(list(CLIENT.glob("*.py"))) + len([p for p in CLIENT.iterdir() if (p / "__init__.py").is_file()]) <= 12


def test_the_layers_are_the_import_contracts() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(contract["layers"] for contract in contracts
                  if contract["type"] == "layers" and contract["layers"][0].startswith("cuctxd.client"))
    stated = " > ".join(f"`{layer.rpartition('.')[2]}/`" for layer in layers)
    assert stated in DOC.read_text()
