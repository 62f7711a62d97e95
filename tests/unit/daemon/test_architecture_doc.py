"""daemon/ARCHITECTURE.md matches the tree: every module or package it names exists, every subpackage is named."""

from __future__ import annotations

import re

from tests.helpers import REPO

DAEMON = REPO / "daemon"
DOC = DAEMON / "ARCHITECTURE.md"
#: A path relative to daemon/ in backticks: `front/`, `worker/loop.py`, `__main__.py`.
NAMED = re.compile(r"`((?:[a-z_]+/)*(?:[a-z_]+\.py|[a-z_]+/))`")


def named_paths() -> set[str]:
    return set(NAMED.findall(DOC.read_text()))


def test_the_doc_names_modules_and_packages() -> None:
    names = named_paths()
    assert "worker/loop.py" in names and "front/" in names  # the pattern reads the doc as written


def test_every_named_module_and_package_exists() -> None:
    missing = sorted(name for name in named_paths()
                     if not (DAEMON / name).is_file() and not (DAEMON / name / "__init__.py").is_file())
    assert missing == []


def test_every_subpackage_is_named() -> None:
    subpackages = {f"{init.parent.relative_to(DAEMON).as_posix()}/" for init in DAEMON.rglob("__init__.py")
                   if init.parent != DAEMON}
    assert subpackages, "no subpackages found under daemon/"
    assert sorted(subpackages - named_paths()) == []


def test_every_reply_destination_is_in_the_ways_in_and_out() -> None:
    """Each way out of a worker (a class in worker/destinations.py with a ``reply``) is named where the doc
    lists them."""
    source = (DAEMON / "worker" / "destinations.py").read_text()
    destinations = set(re.findall(r"^class (\w+):\n(?:(?!^class ).*\n)*?    def reply\(", source, re.MULTILINE))
    assert {"FrontReplies", "LaneReplies", "ShmReplies", "PeerLaneReplies"} <= destinations
    section = DOC.read_text().split("## Ways in and out", 1)[1].split("\n## ", 1)[0]
    assert sorted(name for name in destinations if name not in section) == []
