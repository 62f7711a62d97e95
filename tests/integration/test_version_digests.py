"""A version published without a digest (its tensors copied device to device, which no host hashed) gets one
from the daemon: hashed from the device after the publish, carried from then on, vouched for by the daemon; a
reliance on it meanwhile waits for it; it is parked with the version."""

from __future__ import annotations

import numpy as np
import pytest

from cuctxd import Client
from cuctxd.client.tensors import open_tensors, publish_tensors, publish_version
from cuctxd.protos.errors import DigestMismatch
from cuctxd.protos.layouts import stated_digest
from tests.helpers import DaemonProcess
from tests.integration import test_parking
from tests.service_manager import ServiceManager

#: Two tensors of 3 MiB and 4 KiB: the first cut into two leaves, so a chunk holds leaves of both.
SIZE = 3 << 18


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(SIZE, dtype=np.float32) * version, "b": np.full(1024, version, dtype=np.float32)}


#: The test service manager of one test (standing in for systemd), as the parking tests have it.
manager = test_parking.manager


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "64MiB")


def the_digest_of(client: Client, tensors: dict[str, np.ndarray]) -> str:
    """The digest the client gives the same tensors (published once, hashed on the host)."""
    published = publish_tensors(client, "reference", tensors, persistent=False)
    client.unpublish("reference")
    digest = stated_digest(published.manifest or b"")
    assert digest is not None
    return digest


def test_a_version_without_a_digest_gets_the_one_its_bytes_have_from_the_daemon(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer, Client(daemon.endpoint, name="engine") as engine:
        expected = the_digest_of(trainer, weights(1))
        assert publish_version(trainer, "found", weights(1), digest=False) == 1
        # a reliance waits for the daemon's hashing, then holds it to its result
        with open_tensors(engine, "found", digest=expected) as opened:
            assert opened.version == 1 and opened.digest == expected
            assert all(tensor.spec.digest is not None for tensor in opened.values())
        (listed,) = [s for s in engine.list_shared() if s["name"] == "found"]
        assert listed["digest"] == expected and listed["verified"] == "daemon"
        with pytest.raises(DigestMismatch, match="not the required"):
            open_tensors(engine, "found", digest=the_digest_of(trainer, weights(2)))
        checks = engine.status()["devices"][0]["digest_checks"]
        assert checks["computed"] == 1 and checks["bytes_hashed"] >= 4 * (SIZE + 1024)
        assert publish_version(trainer, "found", weights(2), digest=False) == 2  # each version its own
        with open_tensors(engine, "found", digest=the_digest_of(trainer, weights(2))) as opened:
            assert opened.version == 2
        trainer.unpublish("found")


def test_a_version_with_the_hosts_digest_is_not_hashed_again(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        before = trainer.status()["devices"][0]["digest_checks"]
        publish_version(trainer, "hashed", weights(3))  # hashed on the host while it was written
        with open_tensors(trainer, "hashed", digest=the_digest_of(trainer, weights(3))) as opened:
            assert opened.version == 1
        after = trainer.status()["devices"][0]["digest_checks"]
        assert after["computed"] == before["computed"] and after["bytes_hashed"] == before["bytes_hashed"]
        trainer.unpublish("hashed")


def test_the_digest_found_is_parked_with_the_version_and_comes_back_after_a_restart(manager: ServiceManager) -> None:
    sim = ("--sim-devices", "1", "--sim-memory", "64MiB")
    daemon = manager.start(*sim)
    with Client(daemon.endpoint) as trainer:
        expected = the_digest_of(trainer, weights(4))
        publish_version(trainer, "kept", weights(4), digest=False)
        with open_tensors(trainer, "kept", digest=expected):
            pass  # found before the restart, and parked again with it
    daemon = manager.restart(*sim)
    with Client(daemon.endpoint, name="engine") as engine:
        with open_tensors(engine, "kept", digest=expected) as opened:
            assert opened.version == 1 and opened.digest == expected
        checks = engine.status()["devices"][0]["digest_checks"]
        assert checks["computed"] == 0 and checks["bytes_hashed"] == 0  # not hashed again
        engine.unpublish("kept")
