"""Version buffers are recycled and processes keep their mappings (PROTOCOL.md, section 9, "Versions"): after
warm-up a trainer's next version goes into the name's spare and an engine opens it without an fd or a new mapping;
a held version is never recycled; the spare goes with the name, with a killed trainer's session, and at a restart.
A real daemon process, real client processes."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from cuctxd import BadArgument, Client
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors import open_tensors, publish_version
from cuctxd.client.tensors.publishing import alloc_version, plan_layout, publish_filled
from cuctxd.client.wire import build
from cuctxd.protos.layouts import Manifest
from tests.helpers import DaemonProcess, spawn_client, wait_for_line, wait_until
from tests.integration import test_parking
from tests.integration.test_versions import SIZE, free_memory, spares, weights
from tests.service_manager import ServiceManager


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "64MiB", "--lease-ttl", "1")


#: Holds the current version, moves to each newer one and closes the old, saying what it read and how many
#: mappings it imported (each import took an fd from the daemon) or reused.
ENGINE = """
import numpy as np
from cuctxd import Client
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors import open_tensors, wait_version
with Client(ENDPOINT) as c:
    held = open_tensors(c, NAME)
    while True:
        w = np.asarray(held["w"])
        print("at", held.version, float(w.min()), float(w.max()), VMM_IMPORTS.imported, VMM_IMPORTS.kept(NAME),
              flush=True)
        if held.version == LAST:
            break
        wait_version(c, NAME, held.version, timeout=30)
        newer = held.refresh()
        held.close()
        held = newer
    held.close()
    print("kept after close", VMM_IMPORTS.kept(NAME), flush=True)
"""


def test_after_warm_up_each_version_reuses_the_spare_and_the_engine_maps_nothing_new(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "steady", weights(1))
        one = empty - free_memory(trainer)
        with spawn_client(f"NAME = 'steady'\nLAST = 6\n{ENGINE}", daemon.endpoint) as engine:
            seen = [wait_for_line(engine, "at 1").split()]
            for version in range(2, 7):
                publish_version(trainer, "steady", weights(version))
                seen.append(wait_for_line(engine, f"at {version}").split())
                # the engine closed the older version: its allocation is the spare, the next version's buffer
                assert wait_until(lambda: spares(trainer)["count"] == 1, 5)
                assert free_memory(trainer) == empty - 2 * one  # never a third allocation
            assert wait_for_line(engine, "kept after close").split()[-1] == "0"  # its last version closed
            assert engine.wait(30) == 0
        # every version read its own bytes, whole
        assert [(int(line[1]), float(line[2]), float(line[3])) for line in seen] == [
            (version, float(version), float(version)) for version in range(1, 7)]
        imported = [int(line[4]) for line in seen]
        assert imported == [1, 2, 2, 2, 2, 2]  # from version 3 on: no fd, no import, no map
        assert all(int(line[5]) == 1 for line in seen[1:])  # the spare's mapping, kept
        assert spares(trainer)["reused"] == 4  # versions 3 to 6 went into a spare: nothing allocated
        trainer.unpublish("steady")
        assert wait_until(lambda: free_memory(trainer) == empty, 5)  # the last version went, and the spare
        assert spares(trainer) == {"count": 0, "bytes": 0, "reused": 4}


def test_a_held_version_is_never_recycled(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer, Client(daemon.endpoint) as engine:
        publish_version(trainer, "held-one", weights(1))
        held = open_tensors(engine, "held-one")
        reused = spares(trainer)["reused"]
        for version in range(2, 6):
            publish_version(trainer, "held-one", weights(version))
            assert np.all(np.asarray(held["w"]) == 1.0), f"version 1 changed after version {version}"
        assert spares(trainer)["reused"] - reused == 2  # versions 4 and 5 reused 2 and 3; 1 never
        newer = held.refresh()
        assert newer is not None and np.all(np.asarray(newer["w"]) == 5.0)
        newer.close()
        held.close()
        trainer.unpublish("held-one")
        assert wait_until(lambda: spares(trainer)["count"] == 0, 5)


TRAINER_KILLED_AFTER_ALLOC = """
import sys
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors import publish_version
from cuctxd.client.tensors.publishing import alloc_version
c = Client(ENDPOINT)
for version in (1, 2):
    publish_version(c, NAME, {"w": np.full(SIZE, float(version), dtype=np.float32)})
buffer, buffer_id = alloc_version(c, NAME, SIZE * 4, None)
buffer.fill(0xEE)  # half-written: the version it was for never comes
print("allocated", buffer_id, flush=True)
sys.stdin.read()
"""


def test_a_trainer_killed_after_taking_the_spare_leaves_the_previous_version_and_the_memory_comes_back(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        empty = free_memory(observer)
        code = f"NAME = 'killed'\nSIZE = {SIZE}\n{TRAINER_KILLED_AFTER_ALLOC}"
        with spawn_client(code, daemon.endpoint) as trainer:
            wait_for_line(trainer, "allocated")
            assert spares(observer)["count"] == 0  # version 1's allocation was taken for version 3
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        assert observer.lookup("killed").version == 2
        with open_tensors(observer, "killed") as current:
            assert np.all(np.asarray(current["w"]) == 2.0)
        one = 2 << 20
        assert wait_until(lambda: free_memory(observer) == empty - one, 10)  # freed with the session
        assert spares(observer)["count"] == 0
        observer.unpublish("killed")
        assert wait_until(lambda: free_memory(observer) == empty, 5)


def test_alloc_version_of_another_size_releases_the_spare(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "resized", weights(1))
        publish_version(trainer, "resized", weights(2))
        assert spares(trainer)["count"] == 1
        buffer, _ = alloc_version(trainer, "resized", 6 << 20, None)  # a larger layout: a new allocation
        assert spares(trainer)["count"] == 0
        assert free_memory(trainer) == empty - (2 << 20) - (6 << 20)
        buffer.free()
        trainer.unpublish("resized")
        assert wait_until(lambda: free_memory(trainer) == empty, 5)


#: The test service manager of one test (standing in for systemd), as the parking tests have it.
manager = test_parking.manager


def test_a_spare_is_not_parked_and_live_versions_are_readopted_at_a_restart(manager: ServiceManager) -> None:
    sim = ("--sim-devices", "1", "--sim-memory", "64MiB")
    daemon = manager.start(*sim)
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "restarted", weights(1))
        publish_version(trainer, "restarted", weights(2))
        assert spares(trainer)["count"] == 1
        assert free_memory(trainer) == empty - 2 * (2 << 20)
    assert len([n for n in manager.names() if n.startswith("cuctxd-share-")]) == 1  # version 2 only

    daemon = manager.restart(*sim)
    with Client(daemon.endpoint) as c:
        assert spares(c)["count"] == 0 and free_memory(c) == empty - (2 << 20)  # the spare went with the daemon
        with open_tensors(c, "restarted") as current:
            assert current.version == 2 and np.all(np.asarray(current["w"]) == 2.0)
            assert current.share.descriptor.buffers == (current.share.descriptor.buffer_id,)
        assert publish_version(c, "restarted", weights(3)) == 3
        assert spares(c)["count"] == 1  # version 2, re-adopted, freed: the spare now
        c.unpublish("restarted")
        assert wait_until(lambda: free_memory(c) == empty, 5)


def test_a_trainer_writes_each_version_through_the_mapping_it_kept_until_its_client_closes(
        daemon: DaemonProcess) -> None:
    manifest, sources, size = plan_layout(weights(0))
    imported = VMM_IMPORTS.imported
    with Client(daemon.endpoint) as trainer:
        for version in range(1, 6):  # as publish_version does with CUDA tensors, here through the sim's mapping
            buffer, buffer_id = alloc_version(trainer, "written", size, None)
            leased = VMM_IMPORTS.lease(buffer_id)
            if leased is None:
                with trainer.open_shared(trainer.export(buffer)) as mapped:
                    _write(mapped.host_view(), manifest, version)
            else:
                opening, _ = leased
                _write(opening.view, manifest, version)
                opening.close()
            publish_filled(trainer, "written", manifest, buffer, [None] * len(sources), version=True)
            with open_tensors(trainer, "written") as tensors:
                assert tensors.version == version and np.all(np.asarray(tensors["w"]) == version)
        assert VMM_IMPORTS.imported - imported == 2  # versions 1 and 2; then the spare, mapped already
        assert VMM_IMPORTS.kept("written") == 2  # the current version's buffer and the spare
    assert VMM_IMPORTS.kept("written") == 0  # its client closed: nothing of the name is kept any more
    with Client(daemon.endpoint) as c:
        c.unpublish("written")


def _write(view: memoryview, manifest: Manifest, version: int) -> None:
    """Each tensor of ``weights(version)`` into a buffer of ``manifest`` mapped as ``view``."""
    for spec in manifest.tensors:
        data = np.ascontiguousarray(weights(version)[spec.name]).view(np.uint8)
        view[spec.offset:spec.offset + data.nbytes] = data.data


def test_a_next_version_on_another_device_releases_the_spare_on_its_own(start_daemons) -> None:  # type: ignore[no-untyped-def]
    daemon = start_daemons("--sim-devices", "2", "--sim-memory", "64MiB")
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "moved", weights(1), device=0)
        publish_version(trainer, "moved", weights(2), device=0)
        assert spares(trainer)["count"] == 1
        assert publish_version(trainer, "moved", weights(3), device=1) == 3
        # version 2 went with the publish; device 0's worker sweeps the spare away: the name is on device 1 now
        assert wait_until(lambda: spares(trainer)["count"] == 0, 5)
        assert wait_until(lambda: free_memory(trainer) == empty, 5)
        trainer.unpublish("moved")


def test_a_spare_counts_against_its_publishers_uid_and_gives_way_to_a_publish(start_daemons) -> None:  # type: ignore[no-untyped-def]
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB", "--max-orphaned-bytes-per-uid", "5MiB")
    with Client(daemon.endpoint) as trainer:
        publish_version(trainer, "counted", weights(1))
        publish_version(trainer, "counted", weights(2))
        orphaned = trainer.status()["devices"][0]["orphaned"]
        assert spares(trainer)["count"] == 1 and orphaned["bytes"] == 2 * (2 << 20)  # version 2 and the spare
        publish_version(trainer, "other", weights(1))  # 6 MiB with the spare: the spare goes, the publish passes
        assert spares(trainer)["count"] == 0
        assert trainer.status()["devices"][0]["orphaned"]["bytes"] == 2 * (2 << 20)
        trainer.unpublish("counted")
        trainer.unpublish("other")


def test_a_spare_is_published_only_as_its_names_next_version(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        publish_version(trainer, "only-next", weights(1))
        publish_version(trainer, "only-next", weights(2))
        before = spares(trainer)["count"]
        buffer, _ = alloc_version(trainer, "only-next", plan_layout(weights(3))[2], None)  # the spare: version 1's
        assert spares(trainer)["count"] == before - 1
        for publish in (lambda: trainer.publish(buffer, "elsewhere"),
                        lambda: trainer.run(build.publish(buffer, "another", version=True))):
            with pytest.raises(BadArgument, match="spare"):
                publish()
        buffer.free()  # set to zero before it is released, as any memory that was shared
        trainer.unpublish("only-next")
