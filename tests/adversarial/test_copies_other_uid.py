"""A name's copies belong to its owner's uid (issue 43): another user cannot add a copy of a name it does not own
(``cuctx load --device N``, its own bytes under the name's manifest included), nor remove one; what it tried
leaves nothing behind on the device, and the owner's copies answer as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client
from cuctxd.client.tensors.tensor_sets import open_tensors
from tests.adversarial.other_uid import FORGER_UID, GROUP, OWNER_UID, cuctx_as, needs_root, readable_by_all
from tests.checkpoint_files import write_shard
from tests.helpers import DaemonProcess, remove_tempdir, running_daemon, short_tempdir

TENSORS = {"embed": np.random.default_rng(43).standard_normal((256, 256), dtype=np.float32)}


@pytest.fixture
def group_daemon() -> Iterator[DaemonProcess]:
    """A sim daemon of two devices whose socket the members of :data:`GROUP` may use."""
    root = short_tempdir()
    root.chmod(0o755)
    try:
        with running_daemon("--group", str(GROUP), "--sim-devices", "2", "--sim-memory", "64MiB",
                            endpoint=f"ipc://{root}/run/d.sock", clean_log=True) as daemon:
            yield daemon
    finally:
        remove_tempdir(root)


@pytest.fixture
def model() -> Iterator[Path]:
    directory = short_tempdir()
    write_shard(directory / "model.safetensors", TENSORS)
    try:
        yield readable_by_all(directory) / "model.safetensors"
    finally:
        remove_tempdir(directory)


@needs_root
def test_another_uid_adds_and_removes_no_copy(group_daemon: DaemonProcess, model: Path) -> None:
    endpoint = group_daemon.endpoint
    done = cuctx_as(OWNER_UID, "--endpoint", endpoint, "load", str(model), "--name", "owned", "--device", "0")
    assert done.returncode == 0, done.stderr
    with Client(endpoint) as observer:
        free_before = observer.mem_get_info(1)[0]
    done = cuctx_as(FORGER_UID, "--endpoint", endpoint, "load", str(model), "--name", "owned", "--device", "1")
    assert done.returncode == 1 and "CUCTXD_ERROR_NOT_OWNER" in done.stderr and "may add copies" in done.stderr, done
    done = cuctx_as(FORGER_UID, "--endpoint", endpoint, "unpublish", "owned", "--device", "0")
    assert done.returncode == 1 and "CUCTXD_ERROR_NOT_OWNER" in done.stderr, done
    with Client(endpoint) as observer:
        (listed,) = observer.list_shared()
        assert [copy["device"] for copy in listed["copies"]] == [0]
        assert observer.mem_get_info(1)[0] == free_before  # the refused copy's buffer was freed
        with open_tensors(observer, "owned", device=0) as opened:
            assert np.array_equal(np.asarray(opened["embed"]), TENSORS["embed"])
    done = cuctx_as(OWNER_UID, "--endpoint", endpoint, "load", str(model), "--name", "owned", "--device", "1")
    assert done.returncode == 0 and "copied to device 1" in done.stdout, done.stderr  # its owner may
    with Client(endpoint) as observer:  # another uid relies on the digest: each copy's bytes are hashed once
        digest = observer.list_shared()[0]["digest"]
        said = [observer.verify_shared("owned", digest, device) for device in (1, 0, 1)]
        # device 0's copy was hashed when the other uid's load compared its file with it; device 1's is new
        assert [(one["verified"], one["hashed"]) for one in said] == [("daemon", True), ("daemon", False),
                                                                      ("daemon", False)]
        assert [copy["device"] for copy in observer.list_shared()[0]["copies"]] == [0, 1]
    done = cuctx_as(OWNER_UID, "--endpoint", endpoint, "unpublish", "owned")
    assert done.returncode == 0, done.stderr
