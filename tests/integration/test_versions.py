"""Versioned names through a real daemon and real processes: a trainer publishes versions, engines hold theirs,
wait for newer ones in the daemon and refresh; a trainer killed mid-publish leaves the previous version current."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from cuctxd import AsyncClient, BadArgument, Client, CudaError, LimitExceeded, NotFound, TimedOut
from cuctxd.client.tensors import open_tensors, publish_tensors, publish_version, wait_version
from cuctxd.client.tensors.versions import publish_version_async
from cuctxd.protos.errors import ShuttingDown
from cuctxd.protos.limits import MAX_VERSION_WAITERS
from tests.checkpoint_files import write_shard
from tests.helpers import (
    DaemonProcess,
    cuctx,
    spawn_client,
    wait_for_line,
    wait_until,
)
from tests.integration import test_parking
from tests.service_manager import ServiceManager

#: Each version of the toy model: 1 MiB of float32, its values telling the version apart.
SIZE = 1 << 18


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(SIZE, float(version), dtype=np.float32), "b": np.arange(8, dtype=np.float16) + version}


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "64MiB", "--lease-ttl", "1")


def free_memory(client: Client) -> int:
    return int(client.mem_get_info()[0])


def spares(client: Client) -> dict[str, int]:
    """The device's spares (``status``): count, bytes, reused."""
    found: dict[str, int] = client.status()["devices"][0]["spares"]
    return found


def test_versions_are_numbered_each_with_its_digest_and_the_current_one_is_looked_up(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        assert [publish_version(trainer, "numbered", weights(v)) for v in (1, 2, 3)] == [1, 2, 3]
        current = trainer.lookup("numbered")
        assert current.version == 3
        (listed,) = [s for s in trainer.list_shared() if s["name"] == "numbered"]
        assert listed["version"] == 3 and listed["tensors"] == 2 and not listed["owner_present"]
        with pytest.raises(NotFound, match="no live version 1"):  # nobody held it: freed at version 2
            trainer.lookup("numbered", version=1)
        with open_tensors(trainer, "numbered") as tensors:
            assert tensors.version == 3 and float(np.asarray(tensors["w"])[0]) == 3.0
            third = tensors.digest
        publish_version(trainer, "numbered", weights(4))
        with open_tensors(trainer, "numbered") as tensors:
            assert tensors.version == 4 and tensors.digest not in (None, third)
        with pytest.raises(BadArgument, match="versioned name"):  # a plain replace would skip the numbering
            publish_tensors(trainer, "numbered", weights(5), replace=True)
        assert trainer.lookup("numbered").version == 4
        trainer.unpublish("numbered")


ENGINE = """
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors import open_tensors, wait_version
with Client(ENDPOINT) as c:
    held = open_tensors(c, NAME)
    print("holding", held.version, float(np.asarray(held["w"])[0]), flush=True)
    wait_version(c, NAME, 2, timeout=30)
    newer = held.refresh()
    print("refreshed", newer.version, float(np.asarray(newer["w"])[0]),
          float(np.asarray(held["w"])[0]), flush=True)
    held.close()
    print("closed old", flush=True)
    wait_version(c, NAME, newer.version, timeout=30)
    newer.close()
"""


def test_an_engine_keeps_version_1_while_2_and_3_are_published_and_memory_returns_as_it_leaves(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "held", weights(1))
        one = empty - free_memory(trainer)
        with spawn_client(f"NAME = 'held'\n{ENGINE}", daemon.endpoint) as engine:
            assert wait_for_line(engine, "holding").split() == ["holding", "1", "1.0"]
            publish_version(trainer, "held", weights(2))
            assert free_memory(trainer) == empty - 2 * one  # versions 1 (the engine's) and 2
            publish_version(trainer, "held", weights(3))  # version 2, held by nobody, is freed now
            with pytest.raises(NotFound):
                trainer.lookup("held", version=2)
            # the new version read, and the old one still read its own bytes until it was closed
            assert wait_for_line(engine, "refreshed").split() == ["refreshed", "3", "3.0", "1.0"]
            wait_for_line(engine, "closed old")
            # version 1 freed with its holder (version 2's allocation stays, as the name's spare)
            assert wait_until(lambda: free_memory(trainer) == empty - 2 * one, 5)
            with pytest.raises(NotFound):
                trainer.lookup("held", version=1)
            publish_version(trainer, "held", weights(4))  # the engine closes version 3 and exits
            assert engine.wait(30) == 0
        assert wait_until(lambda: free_memory(trainer) == empty - 2 * one, 5)  # the current version and the spare
        trainer.unpublish("held")
        assert wait_until(lambda: free_memory(trainer) == empty, 5)


def test_every_live_version_counts_against_the_quota_of_its_holder(start_daemons) -> None:  # type: ignore[no-untyped-def]
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB", "--session-quota", "3MiB")
    with Client(daemon.endpoint) as trainer, Client(daemon.endpoint) as engine:
        publish_version(trainer, "quota", weights(1))
        held = open_tensors(engine, "quota")  # 2 MiB (a VMM allocation of 1 MiB and a little): within the quota
        publish_version(trainer, "quota", weights(2))
        with pytest.raises(CudaError, match="session quota"):
            held.refresh()  # both versions would be held
        held.close()
        newer = held.refresh()
        assert newer is not None and newer.version == 2
        newer.close()


WAITER = """
from cuctxd import Client
from cuctxd.client.tensors import wait_version
with Client(ENDPOINT) as c:
    print("waiting", flush=True)
    print("version", wait_version(c, NAME, AFTER, timeout=30), flush=True)
"""


def test_wait_version_is_answered_across_processes_when_the_version_is_published(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        publish_version(trainer, "awaited", weights(1))
        with spawn_client(f"NAME = 'awaited'\nAFTER = 1\n{WAITER}", daemon.endpoint) as waiter:
            wait_for_line(waiter, "waiting")
            publish_version(trainer, "awaited", weights(2))
            assert wait_for_line(waiter, "version").split() == ["version", "2"]
            assert waiter.wait(30) == 0
        assert wait_version(trainer, "awaited", 0) == 2  # already newer: at once
        with pytest.raises(TimedOut, match="no version newer than 2"):
            wait_version(trainer, "awaited", 2, timeout=0.2)
        with pytest.raises(TimedOut):  # a name not published yet is waited for too
            wait_version(trainer, "not-yet", 0, timeout=0.1)
        trainer.unpublish("awaited")


def test_waiters_per_session_are_bounded_and_all_answered_by_one_publish(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.endpoint) as engine:
            waits = [asyncio.ensure_future(engine.wait_version("crowded", 0, 30)) for _ in range(MAX_VERSION_WAITERS)]
            await asyncio.sleep(0)
            with pytest.raises(LimitExceeded, match="MAX_VERSION_WAITERS"):
                await engine.wait_version("crowded", 0, 30)
            with Client(daemon.endpoint) as observer:
                assert observer.status()["devices"][0]["version_waiters"] == MAX_VERSION_WAITERS
            with Client(daemon.endpoint) as trainer:
                async with AsyncClient(daemon.endpoint) as publisher:  # the async form: the same version
                    assert await publish_version_async(publisher, "crowded", weights(1)) == 1
                assert await asyncio.gather(*waits) == [1] * MAX_VERSION_WAITERS
                with open_tensors(trainer, "crowded") as tensors:
                    assert tensors.digest is not None and float(np.asarray(tensors["w"])[-1]) == 1.0
                assert await engine.wait_version("crowded", 0, 30) == 1
                assert trainer.status()["devices"][0]["version_waiters"] == 0
                trainer.unpublish("crowded")

    asyncio.run(main())


def test_a_drain_answers_the_waiters_at_once_and_the_daemon_exits_cleanly(start_daemons) -> None:  # type: ignore[no-untyped-def]
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB")

    async def main() -> None:
        async with AsyncClient(daemon.endpoint) as engine:
            waiting = asyncio.ensure_future(engine.wait_version("never", 0))  # no timeout: an hour in the daemon
            with Client(daemon.endpoint) as observer:  # the wait is in the daemon once status counts it
                while observer.status()["devices"][0]["version_waiters"] != 1:
                    await asyncio.sleep(0.02)
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGTERM)  # a graceful stop: the drain
            with pytest.raises(ShuttingDown, match="wait for a version of 'never'"):
                await waiting
            assert time.monotonic() - started < 5

    asyncio.run(main())
    assert daemon.process.wait(30) == 0


DYING_TRAINER = """
import os, time
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors import publish_version
WEIGHTS = {"w": np.full(1 << 18, 2.0, dtype=np.float32), "b": np.arange(8, dtype=np.float16) + 2}
def written(done, total):
    print("written", done, total, flush=True)
    time.sleep(60)  # SIGKILLed here: every byte of version 2 written, not published
with Client(ENDPOINT) as c:
    publish_version(c, "dying", WEIGHTS, progress=written)
"""


def test_a_trainer_killed_mid_publish_leaves_the_previous_version_current_and_nothing_leaked(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as observer:
        empty = free_memory(observer)
        publish_version(observer, "dying", weights(1))
        with_one = free_memory(observer)
        with spawn_client(DYING_TRAINER, daemon.endpoint) as trainer:
            wait_for_line(trainer, "written")
            assert free_memory(observer) < with_one  # version 2's buffer, being written
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
        current = observer.lookup("dying")
        assert current.version == 1
        with open_tensors(observer, "dying") as tensors:
            assert float(np.asarray(tensors["w"])[0]) == 1.0
        assert wait_until(lambda: free_memory(observer) == with_one, 10)  # freed with the lost session (lease)
        assert publish_version(observer, "dying", weights(2)) == 2
        observer.unpublish("dying")
        assert wait_until(lambda: free_memory(observer) == empty, 5)


def test_copy_into_fills_an_engines_own_arrays_and_refuses_a_mismatch(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as trainer:
        publish_version(trainer, "copied", weights(1))
        own = {"w": np.zeros(SIZE, dtype=np.float32), "b": np.zeros(8, dtype=np.float16)}
        with open_tensors(trainer, "copied") as tensors:
            assert tensors.copy_into(own) == SIZE * 4 + 16
            assert np.array_equal(own["w"], weights(1)["w"]) and np.array_equal(own["b"], weights(1)["b"])
            with pytest.raises(BadArgument, match="cannot be copied"):
                tensors.copy_into({"w": np.zeros(SIZE // 2, dtype=np.float32), "b": own["b"]})
            with pytest.raises(BadArgument, match="no destination"):
                tensors.copy_into({"w": own["w"]})
        trainer.unpublish("copied")


def test_torch_parameters_are_swapped_to_a_refreshed_version_in_place(daemon: DaemonProcess) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: the numpy path is tested above")
    from cuctxd.client.tensors.torch_weights import load_state_dict, swap_parameters

    module = torch.nn.Linear(4, 2)
    with Client(daemon.endpoint) as trainer:
        for version in (1, 2):
            state = {"weight": torch.full((2, 4), float(version)), "bias": torch.full((2,), float(version))}
            assert publish_version(trainer, "swapped", state) == version
            if version == 1:
                loaded = load_state_dict(trainer, "swapped")
                parameter = module.weight
                swap_parameters(module, loaded)
                assert loaded.version == 1 and module.weight.detach()[0, 0].item() == 1.0
        newer = loaded.refresh()
        assert newer is not None and newer.version == 2 and newer.refresh() is None
        swap_parameters(module, newer)
        loaded.close()
        assert module.weight is parameter and module.weight.detach()[0, 0].item() == 2.0  # the same Parameter
        copied = torch.nn.Linear(4, 2)
        assert newer.copy_into(copied) == 4 * (8 + 2)
        assert copied.bias.detach()[1].item() == 2.0
        del module, parameter  # nothing computes with version 2 any more (the sim refuses to unmap memory in use)
        gc.collect()
        newer.close()
        trainer.unpublish("swapped")


#: The test service manager of one test (standing in for systemd), as the parking tests have it.
manager = test_parking.manager


def test_two_live_versions_survive_a_restart_with_their_numbers_and_the_current_one_stays_current(
        manager: ServiceManager) -> None:
    sim = ("--sim-devices", "1", "--sim-memory", "64MiB", "--orphan-ttl", "600")
    daemon = manager.start(*sim)
    with Client(daemon.endpoint) as trainer:
        publish_version(trainer, "parked", weights(1))
        engine = Client(daemon.endpoint, name="engine")
        held = open_tensors(engine, "parked")  # version 1 stays live, held
        publish_version(trainer, "parked", weights(2))
        with_two = free_memory(trainer)
    assert len([n for n in manager.names() if n.startswith("cuctxd-share-")]) == 2

    daemon = manager.restart(*sim)
    with Client(daemon.endpoint) as c:
        assert free_memory(c) == with_two  # both versions adopted
        assert c.lookup("parked").version == 2
        assert [s["version"] for s in c.list_shared() if s["name"] == "parked"] == [2]
        assert wait_version(c, "parked", 1) == 2
        with open_tensors(c, "parked") as current:
            assert current.version == 2 and float(np.asarray(current["w"])[0]) == 2.0
        # the engine's mapping outlived the daemon; version 1 is kept until a session holds it again
        assert float(np.asarray(held["w"])[0]) == 1.0
        old = c.open_shared(c.lookup("parked", version=1))
        assert old.descriptor.version == 1 and bytes(old.host_view()[:4]) == np.float32(1.0).tobytes()
        old.close()  # its last holder let go: its allocation is the name's spare now
        assert spares(c)["count"] == 1 and free_memory(c) == with_two
        with pytest.raises(NotFound):
            c.lookup("parked", version=1)
        assert publish_version(c, "parked", weights(3)) == 3  # the numbering goes on, in the spare
        assert spares(c) == {"count": 1, "bytes": 2 << 20, "reused": 1}  # version 2's allocation is spare now
        c.unpublish("parked")
        assert wait_until(lambda: spares(c)["count"] == 0, 5)
    assert "adopted 2 parked share(s)" in daemon.log()
    engine.close()  # its session went with the old daemon


def test_cuctx_loads_checkpoints_as_versions_and_waits_for_one(daemon: DaemonProcess, tmp_path: Path) -> None:
    endpoint = ("--endpoint", daemon.endpoint)
    first = write_shard(tmp_path / "a.safetensors", {"w": np.full(64, 1.0, dtype=np.float32)})
    second = write_shard(tmp_path / "b.safetensors", {"w": np.full(64, 2.0, dtype=np.float32)})
    loaded = [cuctx("load", str(path), "--name", "cli-policy", "--version", "--json", *endpoint) for path in
              (first, first, second)]  # the same content again is a version too
    assert [done.returncode for done in loaded] == [0, 0, 0], [done.stderr for done in loaded]
    assert [json.loads(done.stdout)["version"] for done in loaded] == [1, 2, 3]
    waited = cuctx("wait-version", "cli-policy", "--after", "2", *endpoint)
    assert waited.returncode == 0 and waited.stdout.strip() == "'cli-policy' version 3"
    late = cuctx("wait-version", "cli-policy", "--after", "3", "--wait", "0.2", *endpoint)
    assert late.returncode == 1 and "CUCTXD_ERROR_TIMED_OUT" in late.stderr
    listed = cuctx("shared", *endpoint)
    assert "cli-policy v3" in listed.stdout
    with Client(daemon.endpoint) as c, open_tensors(c, "cli-policy") as tensors:
        assert tensors.version == 3 and float(np.asarray(tensors["w"])[0]) == 2.0
        c.unpublish("cli-policy")


def test_an_older_version_nobody_holds_again_after_a_restart_goes_with_the_orphan_ttl(manager: ServiceManager) -> None:
    sim = ("--sim-devices", "1", "--sim-memory", "64MiB", "--orphan-ttl", "1")
    daemon = manager.start(*sim)
    with Client(daemon.endpoint) as trainer:
        empty = free_memory(trainer)
        publish_version(trainer, "expiring", weights(1))
        one = empty - free_memory(trainer)
        engine = Client(daemon.endpoint, name="engine")
        open_tensors(engine, "expiring")  # held until the daemon goes
        publish_version(trainer, "expiring", weights(2))
        assert free_memory(trainer) == empty - 2 * one
    daemon = manager.restart(*sim)
    with Client(daemon.endpoint) as c:
        assert wait_until(lambda: spares(c)["count"] == 1, 10)  # version 1's ttl passed: its allocation is spare
        with pytest.raises(NotFound):
            c.lookup("expiring", version=1)
        assert c.lookup("expiring").version == 2  # the current one is persistent
        assert [n for n in manager.names() if n.startswith("cuctxd-share-")] != []
        c.unpublish("expiring")
        assert wait_until(lambda: free_memory(c) == empty, 5)  # its last version went: the spare with it
        assert spares(c)["count"] == 0
    engine.close()
