"""Digest checks on a real GPU (issue 40, item 2): ``verify_shared`` hashes a layout's device memory (pinned
DMA ring, XXH3 on helper threads) to the digest the client computed from the host bytes, for a pool share and
a VMM share; bytes changed on the device after publishing are found; a 2.5 GiB check lets a bystander on the
same device be served meanwhile, and prints its seconds and GB/s (run with ``-s`` to see them).

The reliers connect over tcp://, whose peers have no known uid: never the publisher's user, so always hashed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cuctxd import Client, DigestMismatch
from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.tensors.publishing import plan_layout, publish_filled, publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.protos.layouts import check_manifest
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon, tcp_endpoint

GIB = 1 << 30


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp", backend="cuda", ready_timeout=120)
    yield process
    code = process.stop(timeout=60)
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()}"
    assert "Traceback" not in process.log(), process.log()[-5000:]


def random_tensors(total: int, count: int, seed: int) -> dict[str, np.ndarray]:
    """``count`` uint8 tensors of about ``total`` bytes, sizes not multiples of the digest's 2 MiB leaves."""
    data = np.random.default_rng(seed).integers(0, 256, total + 12345, dtype=np.uint8)
    return {f"t{i}": part for i, part in enumerate(np.array_split(data, count))}


def checks(client: Client) -> dict[str, Any]:
    checked: dict[str, Any] = client.status()["devices"][0]["digest_checks"]
    return checked


@pytest.mark.parametrize("size", [24 << 20, 300 << 20], ids=["below POOL_BUFFER_MAX", "above"])
def test_the_device_hashes_to_the_clients_digest(daemon: DaemonProcess, size: int) -> None:
    name = f"checked-{size}"
    with Client(daemon.endpoint, name="producer") as producer, Client(tcp_endpoint(daemon), name="relier") as relier:
        descriptor = publish_tensors(producer, name, random_tensors(size, 5, seed=size))
        if descriptor.mechanism != "vmm":
            pytest.skip(f"this device shares buffers as {descriptor.mechanism!r}, not VMM")
        digest = check_manifest(descriptor.manifest, descriptor.size).digest
        assert digest is not None
        before = checks(relier)["checked"]
        assert relier.verify_shared(name, digest, 0) == {"digest": digest, "verified": "daemon", "hashed": True}
        assert relier.verify_shared(name, digest, 0)["hashed"] is False
        assert checks(relier)["checked"] == before + 1 and checks(relier)["mismatches"] == 0
        assert checks(relier)["staging_bytes"] == 0
        producer.unpublish(name)


def test_bytes_changed_on_the_device_are_found(daemon: DaemonProcess) -> None:
    """The producer publishes its digests of the host bytes, then changes two bytes on the device."""
    tensors = random_tensors(64 << 20, 3, seed=7)
    manifest, _, size = plan_layout(tensors)
    with Client(daemon.endpoint, name="producer") as producer, Client(tcp_endpoint(daemon), name="relier") as relier:
        buffer = producer.alloc(size, 0, shareable=True)
        for spec, array in zip(manifest.tensors, tensors.values(), strict=True):
            buffer.write(array, spec.offset)
        descriptor = publish_filled(producer, "changed", manifest, buffer, hash_views(
            [memoryview(array) for array in tensors.values()]))
        digest = check_manifest(descriptor.manifest, descriptor.size).digest
        assert digest is not None
        last = manifest.tensors[-1]
        buffer.write(b"\xff\x00", last.offset + last.nbytes - 2)  # two bytes of the last leaf
        with pytest.raises(DigestMismatch, match="do not have"):
            open_tensors(relier, "changed", digest=digest)
        assert next(s for s in relier.list_shared() if s["name"] == "changed")["verified"] == "mismatch"
        producer.unpublish("changed")


def test_a_large_check_serves_a_bystander_meanwhile(daemon: DaemonProcess) -> None:
    size = int(2.5 * GIB)
    with Client(daemon.endpoint, name="producer", timeout=300) as producer:
        descriptor = publish_tensors(producer, "large", random_tensors(size, 10, seed=3))
        digest = check_manifest(descriptor.manifest, descriptor.size).digest
        assert digest is not None
        took: list[float] = []

        def rely() -> None:
            with Client(tcp_endpoint(daemon), name="relier", timeout=300) as relier:
                started = time.perf_counter()
                assert relier.verify_shared("large", digest, 0)["hashed"] is True
                took.append(time.perf_counter() - started)

        relier = threading.Thread(target=rely)
        served = 0
        longest = 0.0
        with Client(daemon.endpoint, name="bystander") as bystander:
            buffer = bystander.alloc(4096, 0)
            relier.start()
            while relier.is_alive():
                started = time.perf_counter()
                buffer.write(b"\x01" * 4096)
                longest = max(longest, time.perf_counter() - started)
                if checks(bystander)["running"] == "large":
                    served += 1
            relier.join()
        assert took, "the reliance failed"
        print(f"\nverify a {size / GIB:.1f} GiB layout on the device: {took[0]:.3f} s, "
              f"{size / took[0] / 1e9:.1f} GB/s; a bystander was served {served} times meanwhile, its slowest "
              f"4 KiB write {longest * 1e3:.2f} ms")
        assert served, "the device answered nobody while it checked the digest"
        producer.unpublish("large")
