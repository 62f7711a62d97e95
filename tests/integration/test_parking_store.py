"""Parking against the service manager's fd store (tests/service_manager.py): a change is in the store before its
reply, a full store (or a uid's share of it) refuses a persistent publish by name, each change writes its own
record only, and what a daemon before format 2 parked is still adopted."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from cuctxd import Client, CuctxError, NotFound, NotParked
from cuctxd.client.wire import build as requests
from cuctxd.daemon.registry.parked_records import decode_record, encode_registry
from cuctxd.protos.memfd import sealed_memfd
from tests.checkpoint_files import write_shard
from tests.helpers import cuctx
from tests.reliability.strategies import scaled, soak_mode
from tests.service_manager import ServiceManager, managed

SIM = ("--sim-devices", "1", "--sim-memory", "256MiB")
#: Rounds of change-then-SIGKILL (each change twice; ``CUCTXD_SOAK=1``: 50 times as many), and the seconds
#: a round may take.
ROUNDS = scaled(8)
ROUND_BUDGET_S = 5.5


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    with managed() as service:
        yield service


def publish_persistent(client: Client, name: str, manifest: bytes | None = None, *, replace: bool = False,
                       size: int = 4096) -> tuple[object, str]:
    """(buffer, share id) of a new shareable buffer published ``persistent`` as ``name``."""
    buffer = client.alloc(size, shareable=True)
    share = client.run(requests.publish(buffer, name, manifest, True, False, replace=replace))
    return buffer, share.share_id


def share_fdnames(manager: ServiceManager) -> set[str]:
    return {name for name in manager.names() if name.startswith("cuctxd-share-")}


class Bystander:
    """Another session's device ops in a loop on a thread (``stop`` ends it): load on the worker, and each op's
    latency."""

    def __init__(self, endpoint: str) -> None:
        self.client = Client(endpoint, name="bystander")
        self.buffer = self.client.alloc(4096)
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self.client.write(self.buffer, b"x" * 4096)
            except CuctxError:  # the daemon was killed
                return
            self.latencies.append(time.perf_counter() - started)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(10)
        latencies, self.latencies = self.latencies, []
        return latencies

    def close(self) -> None:
        self.client.close()


def _unpublish(client: Client, name: str, buffer: object) -> None:
    client.unpublish(name)


def _replace(client: Client, name: str, buffer: object) -> None:
    publish_persistent(client, name, replace=True)


def _revoke(client: Client, name: str, buffer: object) -> None:
    client.revoke(buffer)  # type: ignore[arg-type]


def _free(client: Client, name: str, buffer: object) -> None:
    client.free(buffer)  # type: ignore[arg-type]


CHANGES: list[Callable[[Client, str, object], None]] = [_unpublish, _replace, _revoke, _free]


@pytest.mark.timeout(0 if soak_mode() else 60)
def test_a_change_answered_before_a_sigkill_is_what_the_next_start_finds(manager: ServiceManager) -> None:
    """Unpublish, replace, revoke and free of a parked share, each SIGKILLed right after its reply, under load:
    the name never comes back (a replaced one comes back as its new share), the other names always do."""
    daemon = manager.start(*SIM)
    deadline = time.monotonic() + ROUNDS * ROUND_BUDGET_S
    for round_ in range(ROUNDS):
        assert time.monotonic() < deadline, f"only {round_} rounds in {ROUNDS * ROUND_BUDGET_S} s"
        change = CHANGES[round_ % len(CHANGES)]
        bystander = Bystander(daemon.endpoint)
        producer = Client(daemon.endpoint, name="producer")
        _, kept = publish_persistent(producer, f"kept-{round_}")
        target, old = publish_persistent(producer, f"target-{round_}")
        change(producer, f"target-{round_}", target)
        manager.kill()  # right after the reply, the bystander's ops still coming: nothing later reaches the store
        daemon = manager.start(*SIM, endpoint=daemon.endpoint)
        bystander.stop()  # its session is lost by now
        bystander.close()
        producer.close()
        with Client(daemon.endpoint) as c:
            listed = {s["name"]: s["share_id"] for s in c.list_shared()}
            for name in listed:  # the next round starts from an empty store
                c.unpublish(name)
        assert listed[f"kept-{round_}"] == kept, change.__name__
        if change is _replace:
            assert listed[f"target-{round_}"] != old
        else:
            assert f"target-{round_}" not in listed, change.__name__
        assert f"cuctxd-share-{old}" not in share_fdnames(manager), change.__name__


def test_a_uid_takes_no_more_than_its_share_of_the_store_and_status_says_so(manager: ServiceManager) -> None:
    """The store keeps 64 fds, a uid a quarter of them (16: 8 shares of 2); the 9th persistent publish fails by
    name and names nothing; the parked fds show in status and in the fd budget."""
    daemon = manager.start(*SIM)
    with Client(daemon.endpoint) as c:
        for index in range(8):
            publish_persistent(c, f"w{index}")
        with pytest.raises(NotParked, match="max_parked_fds_per_uid"):
            publish_persistent(c, "one too many")
        with pytest.raises(NotFound):
            c.lookup("one too many")
        plain = c.alloc(4096, shareable=True)
        c.publish(plain, "not persistent")  # a name that is not persistent still publishes
        status = c.status()
    parking = status["parking"]
    assert parking["store_max"] == 64 and parking["max_per_uid"] == 16
    assert parking["fds"] == 16 and parking["shares"] == 8 and parking["refused"] == 1
    assert parking["uids"] == [{"uid": os.getuid(), "fds": 16}]
    budget_peers = {peer["peer"]: peer["held"] for peer in status["fd_budget"]["top_peers"]}
    assert budget_peers[f"parked, uid {os.getuid()}"] == 16
    assert len(share_fdnames(manager)) == 8
    cli = cuctx("--endpoint", daemon.endpoint, "status")
    assert cli.returncode == 0, cli.stderr
    assert "parked: 8 share(s), 16/64 fds of the service manager's fd store" in cli.stdout
    assert "16/16" in cli.stdout and "1 persistent publish(es) refused" in cli.stdout


def test_a_full_store_refuses_a_persistent_publish_by_name_and_the_restart_keeps_the_rest(tmp_path: Path) -> None:
    """A store of 10 fds holds 4 shares (2 each, and one spare for a record's next generation); the 5th
    persistent publish fails with NOT_PARKED, ``cuctx load`` (which publishes persistent) says so, and neither
    is there after a restart; the 4 are."""
    checkpoint = write_shard(tmp_path / "model.safetensors", {"w": np.ones(16, dtype=np.float32)})
    with managed(store_max=10) as manager:
        daemon = manager.start(*SIM, "--max-parked-fds-per-uid", "10")
        with Client(daemon.endpoint) as c:
            ids = {f"w{index}": publish_persistent(c, f"w{index}")[1] for index in range(4)}
            with pytest.raises(NotParked, match="fd store is full"):
                publish_persistent(c, "victim")
        loaded = cuctx("--endpoint", daemon.endpoint, "load", str(checkpoint), "--name", "checkpoint")
        assert loaded.returncode != 0 and "CUCTXD_ERROR_NOT_PARKED" in loaded.stderr, loaded.stderr
        assert "fd store is full" in loaded.stderr
        daemon = manager.restart(*SIM, "--max-parked-fds-per-uid", "10")
        with Client(daemon.endpoint) as c:
            assert {s["name"]: s["share_id"] for s in c.list_shared()} == ids


def test_each_change_writes_its_own_record_and_a_bystander_is_not_held_up() -> None:
    """One uid publishes persistent names with 512 KiB manifests: each publish stores one record of about its
    manifest's size, however many are parked (a counter in status, not a timing); a bystander's device ops meanwhile
    take about what they take while the same names are published without persistent (the baseline)."""
    count = 24
    manifest = msgpack.packb({"tensors": [{"name": "w", "dtype": "uint8", "shape": [16], "offset": 0}],
                              "metadata": {"pad": "m" * ((512 << 10) - 200)}})
    with managed(store_max=1024) as manager:
        daemon = manager.start(*SIM, "--max-parked-fds-per-uid", "1024")
        bystander = Bystander(daemon.endpoint)
        with Client(daemon.endpoint, name="publisher") as c:
            for index in range(count):
                buffer = c.alloc(4096, shareable=True)
                c.run(requests.publish(buffer, f"plain-{index}", manifest, False, False))
            baseline = bystander.stop()
            bystander.close()
            for index in range(count):
                c.unpublish(f"plain-{index}")  # within max_manifest_bytes_per_session for the parked ones
            bystander = Bystander(daemon.endpoint)
            written = [c.status()["parking"]["record_bytes_written"]]
            for index in range(count):
                publish_persistent(c, f"parked-{index}", manifest)
                written.append(c.status()["parking"]["record_bytes_written"])
            parked = bystander.stop()
        steps = [after - before for before, after in itertools.pairwise(written)]
        assert all(len(manifest) <= step < len(manifest) + 4096 for step in steps), steps
        assert max(parked) <= 3 * max(baseline) + 0.05, (max(parked), max(baseline))
        bystander.close()


def test_a_format_1_registry_of_an_older_daemon_is_adopted_and_rewritten_as_records(manager: ServiceManager) -> None:
    """A daemon upgrade keeps what the older one parked: its single registry (format 1) is read at start, the
    shares adopted, each given its own record, and the registry removed from the store."""
    daemon = manager.start(*SIM)
    with Client(daemon.endpoint) as c:
        _, first = publish_persistent(c, "first")
        _, second = publish_persistent(c, "second")
    manager.kill()
    records = [name for name in manager.names() if name.startswith("cuctxd-record-")]
    shares = []
    for name in records:
        (fd,) = manager.take(name)
        shares.append(decode_record(_read_all(fd))[1])
    raw = encode_registry(shares, 7)
    registry = sealed_memfd("old-registry", len(raw))
    os.pwrite(registry, raw, 0)
    manager.add("cuctxd-registry-7", registry)

    daemon = manager.start(*SIM, endpoint=daemon.endpoint)
    with Client(daemon.endpoint) as c:
        assert {s["name"]: s["share_id"] for s in c.list_shared()} == {"first": first, "second": second}
    names = manager.names()
    assert "cuctxd-registry-7" not in names
    assert len([n for n in names if n.startswith("cuctxd-record-")]) == 2
    daemon = manager.restart(*SIM)  # and the records written then are what the next start reads
    with Client(daemon.endpoint) as c:
        assert sorted(s["name"] for s in c.list_shared()) == ["first", "second"]


def _read_all(fd: int) -> bytes:
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
