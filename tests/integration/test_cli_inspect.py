"""``cuctx inspect`` against a real daemon, and what a new user hit with the CLI: a misspelled flag named with
the closest one, and errors under ``--json`` as JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest

from cuctxd import Client, publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from tests.helpers import DaemonProcess, cuctx


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "2", "--sim-memory", "64MiB")


@pytest.fixture
def layout(daemon: DaemonProcess) -> Iterator[int]:
    """``inspected`` published on both devices, its copy on device 0 held open by a session (its id)."""
    with Client(daemon.endpoint) as publisher, Client(daemon.endpoint) as holder:
        publish_tensors(publisher, "inspected", {"embed": np.zeros((4, 8), np.float32),
                                                 "step": np.array([3], np.int64)}, {"arch": "toy"}, device=[0, 1])
        with open_tensors(holder, "inspected", device=0):
            yield holder.session_id
        publisher.unpublish("inspected")


def test_inspect_lists_tensors_digest_copies_and_holders(daemon: DaemonProcess, layout: int) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "inspect", "inspected", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert [(t["name"], t["dtype"], t["shape"], t["offset"], t["nbytes"]) for t in found["tensors"]] == [
        ("embed", "float32", [4, 8], 0, 128), ("step", "int64", [1], 256, 8)]
    assert found["digest"].startswith("xxh3-128:") and found["metadata"] == {"arch": "toy"}
    assert [(c["device"], c["holders"]) for c in found["copies"]] == [(0, [layout]), (1, [])]
    table = cuctx("--endpoint", daemon.endpoint, "inspect", "inspected")
    assert table.returncode == 0, table.stderr
    assert found["digest"] in table.stdout
    assert re.search(r"^embed +float32 +4x8 +0 +128$", table.stdout, re.MULTILINE)
    assert f"held by session(s) {layout}" in table.stdout and "held by nobody" in table.stdout


def test_errors_under_json_are_json(daemon: DaemonProcess) -> None:
    done = cuctx("--endpoint", daemon.endpoint, "inspect", "no-such-layout", "--json")
    assert done.returncode == 1
    error = json.loads(done.stderr)
    assert error["error"] == "CUCTXD_ERROR_NOT_FOUND" and "no-such-layout" in error["message"]


@pytest.mark.parametrize(("argv", "said"), [
    (["load", "model.safetensors", "--nmae", "x"], "unrecognized option '--nmae'; did you mean '--name'?"),
    (["devices", "--jsn"], "unrecognized option '--jsn'; did you mean '--json'?"),
    (["devices", "--js"], "unrecognized option '--js'; did you mean '--json'?"),  # no abbreviations
])
def test_a_misspelled_flag_is_named_with_the_closest_one(argv: list[str], said: str) -> None:
    done = cuctx(*argv)
    assert done.returncode == 2
    assert said in done.stderr and "required" not in done.stderr
