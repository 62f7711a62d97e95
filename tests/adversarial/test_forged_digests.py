"""A digest is no longer taken on its publisher's word (issue 40, item 2).

Another uid publishes other bytes under a name, with the manifest ``cuctx load`` of a real checkpoint would
make, the real digests included. Before, the owner's ``cuctx load`` of the real file answered "already
loaded: same content" (with ``--replace`` too) and ``open_tensors(name, digest=real)`` mapped the forgery. Now
every reliance on a digest of another uid goes through ``verify_shared``, which hashes the device memory once:
the forgery fails by name, saying who holds it, and a genuine layout of another uid is checked once, then
trusted from the verdict. A digest of one's own uid is never hashed. The daemon runs as root; the forger and a
second owner run as uids of their own (:mod:`tests.adversarial.other_uid`), so these tests need root.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cuctxd import Client, DigestMismatch
from cuctxd.client.tensors.checkpoints import read_checkpoint
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.safetensors_load import checkpoint_digest
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.layouts import check_manifest
from tests.adversarial.attacks import Bystander, assert_alive
from tests.adversarial.other_uid import (
    FORGER_UID,
    GROUP,
    OWNER_UID,
    cuctx_as,
    needs_root,
    readable_by_all,
    run_as,
)
from tests.checkpoint_files import write_shard
from tests.helpers import DaemonProcess, cuctx, remove_tempdir, running_daemon, short_tempdir, tcp_endpoint


@pytest.fixture
def attack_daemon() -> Iterator[DaemonProcess]:
    """A sim daemon whose socket the members of :data:`GROUP` may use (its directory made by the daemon, under
    one every user may pass through), with a tcp:// endpoint too (peers of no known uid)."""
    root = short_tempdir()
    root.chmod(0o755)
    try:
        with running_daemon("--group", str(GROUP), "--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp",
                            "--sim-memory", "512MiB", endpoint=f"ipc://{root}/run/d.sock", clean_log=True) as daemon:
            yield daemon
            assert_alive(daemon)
    finally:
        remove_tempdir(root)


@pytest.fixture
def model() -> Iterator[Path]:
    """A checkpoint every uid may read: one tensor spans several digest leaves and chunks of a check."""
    directory = short_tempdir()
    rng = np.random.default_rng(40)
    write_shard(directory / "model.safetensors", {"embed": rng.standard_normal((2048, 2560), dtype=np.float32),
                                                  "ids": np.arange(7, dtype=np.int64)})
    try:
        yield readable_by_all(directory) / "model.safetensors"
    finally:
        remove_tempdir(directory)


def forge(daemon: DaemonProcess, model: Path, name: str) -> None:
    done = run_as(FORGER_UID, "-m", "tests.adversarial.other_uid", daemon.endpoint, str(model), name)
    assert done.returncode == 0, done.stderr


def load(daemon: DaemonProcess, model: Path, name: str, *flags: str, uid: int | None = None) -> tuple[int, str]:
    args = ("--endpoint", daemon.endpoint, "load", str(model), "--name", name, *flags)
    done = cuctx(*args) if uid is None else cuctx_as(uid, *args)
    return done.returncode, done.stdout + done.stderr


def checks(client: Client) -> dict[str, Any]:
    checked: dict[str, Any] = client.status()["devices"][0]["digest_checks"]
    return checked


def listed(client: Client, name: str) -> dict[str, Any]:
    return next(s for s in client.list_shared() if s["name"] == name)


@needs_root
def test_a_forged_digest_is_caught_on_every_path(attack_daemon: DaemonProcess, bystander: Bystander,
                                                  model: Path) -> None:
    real = checkpoint_digest(read_checkpoint(str(model)))
    forge(attack_daemon, model, "forged")
    with Client(attack_daemon.endpoint, name="victim") as victim:
        assert victim.lookup("forged").publisher["uid"] == FORGER_UID
        assert check_manifest(victim.lookup("forged").manifest, 1 << 30).digest == real, "the forgery claims it"
        code, said = load(attack_daemon, model, "forged", uid=OWNER_UID)  # hashes its file, then asks the daemon
        assert code == 1 and "same content" not in said, said
        assert "CUCTXD_ERROR_NAME_EXISTS" in said and f"uid {FORGER_UID}" in said and "forger" in said, said
        assert listed(victim, "forged")["verified"] == "mismatch"
        assert checks(victim)["checked"] == 1 and checks(victim)["mismatches"] == 1
        with pytest.raises(DigestMismatch, match=f"uid {FORGER_UID}") as raised:
            open_tensors(victim, "forged", digest=real)
        assert raised.value.code == 10018
        with pytest.raises(DigestMismatch, match="do not have"):
            victim.lookup("forged", digest=real)
        code, said = load(attack_daemon, model, "forged", "--replace", uid=OWNER_UID)
        assert code == 1 and "same content" not in said, said
        assert "CUCTXD_ERROR_NOT_OWNER" in said and f"uid {FORGER_UID}" in said, said
        assert checks(victim)["checked"] == 1, "the verdict is kept: nothing hashed again"
        assert listed(victim, "forged")["publisher"]["uid"] == FORGER_UID
        code, said = load(attack_daemon, model, "forged", "--replace")  # the daemon's own user may replace it
        assert code == 0 and said.startswith("replaced"), said
        assert listed(victim, "forged")["verified"] is None and listed(victim, "forged")["digest"] == real
        with open_tensors(victim, "forged", digest=real) as tensors:  # its own user's: not hashed
            assert tensors.manifest.digest == real
        assert checks(victim)["checked"] == 1
    assert re.search(rf"the digest of 'forged' does not match its bytes: its publisher, session \d+ \('forger', "
                     rf"uid {FORGER_UID}", attack_daemon.log())


@needs_root
def test_a_genuine_layout_of_another_uid_is_checked_once(attack_daemon: DaemonProcess, model: Path) -> None:
    code, said = load(attack_daemon, model, "genuine", uid=FORGER_UID)
    assert code == 0, said
    real = checkpoint_digest(read_checkpoint(str(model)))
    with Client(attack_daemon.endpoint, name="user") as user:
        assert listed(user, "genuine")["verified"] is None
        code, said = load(attack_daemon, model, "genuine", uid=OWNER_UID)
        assert code == 0 and said.startswith("already loaded: same content"), said
        assert listed(user, "genuine")["verified"] == "daemon"
        assert checks(user)["checked"] == 1 and checks(user)["bytes_hashed"] == 2048 * 2560 * 4 + 7 * 8
        assert user.verify_shared("genuine", real, 0) == {"digest": real, "verified": "daemon", "hashed": False}
        with open_tensors(user, "genuine", digest=real) as tensors:
            assert tensors.manifest.digest == real
        code, said = load(attack_daemon, model, "genuine", "--replace", uid=OWNER_UID)
        assert code == 0 and said.startswith("already loaded: same content"), said
        assert checks(user)["checked"] == 1, "the second reliance read the verdict"
        assert user.lookup("genuine").publisher["uid"] == FORGER_UID


def test_ones_own_digest_is_not_hashed(attack_daemon: DaemonProcess) -> None:
    with Client(attack_daemon.endpoint, name="producer") as producer, Client(attack_daemon.endpoint) as consumer:
        published = publish_tensors(producer, "mine", {"w": np.arange(1 << 20, dtype=np.float32)})
        digest = check_manifest(published.manifest, published.size).digest
        assert digest is not None
        assert consumer.verify_shared("mine", digest, 0) == {"digest": digest, "verified": "publisher", "hashed": False}
        with pytest.raises(DigestMismatch, match="not the required"):
            consumer.verify_shared("mine", digest.replace("xxh3-128:", "xxh3-128:f")[:41], 0)
        assert checks(consumer)["checked"] == 0 and listed(consumer, "mine")["verified"] is None


def test_a_check_serves_the_device_meanwhile_and_runs_once_for_concurrent_reliances(
        attack_daemon: DaemonProcess) -> None:
    """tcp:// peers have no known uid, so nobody there is the publisher's user: their reliances are checked. Two
    sessions rely on a 192 MiB layout at once; one check runs, and a bystander on the same device is answered
    while it does."""
    endpoint = tcp_endpoint(attack_daemon)
    with Client(endpoint, name="producer") as producer:
        rng = np.random.default_rng(2)
        published = publish_tensors(producer, "large", {"a": rng.integers(0, 255, 96 << 20, dtype=np.uint8),
                                                        "b": rng.integers(0, 255, 96 << 20, dtype=np.uint8)})
    digest = check_manifest(published.manifest, published.size).digest
    assert digest is not None
    answers: list[dict[str, Any]] = []

    def rely() -> None:
        with Client(endpoint, name="relier") as relier:
            answers.append(relier.verify_shared("large", digest, 0))

    reliers = [threading.Thread(target=rely) for _ in range(2)]
    served_while_checking = 0
    with Client(endpoint, name="bystander") as bystander:
        buffer = bystander.alloc(4096, 0)
        for relier in reliers:
            relier.start()
        while any(relier.is_alive() for relier in reliers):
            buffer.write(b"\x01" * 4096)
            assert buffer.read() == b"\x01" * 4096
            if checks(bystander)["running"] == "large":
                served_while_checking += 1
        for relier in reliers:
            relier.join()
        assert served_while_checking, "the device answered nobody while it checked the digest"
        assert [answer["verified"] for answer in answers] == ["daemon", "daemon"], answers
        assert checks(bystander)["checked"] == 1 and checks(bystander)["staging_bytes"] == 0
        assert listed(bystander, "large")["verified"] == "daemon"
