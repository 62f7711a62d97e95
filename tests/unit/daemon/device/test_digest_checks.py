"""Digest checks (``verify_shared``) against a plain SimDriver, the test thread playing the device worker: the
daemon's chunked hashing gives the very digests the client computes, a forgery is found, a check keeps its
share alive until it ends, and a verdict is read, not hashed again."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cuctxd.client.tensors.hashing import hash_views
from cuctxd.client.tensors.publishing import layout_offsets
from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.digest_checks import Chunk, hash_chunk, plan_chunks
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers import DEVICE_HANDLERS
from cuctxd.daemon.handlers.replies import Pending, Reply
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos import digests
from cuctxd.protos.errors import CuctxError, DigestMismatch
from cuctxd.protos.layouts import Manifest, TensorSpec, c_strides
from cuctxd.protos.schema import OPS, decode_args
from tests.helpers import wait_until

LEAF = digests.LEAF_BYTES
_ids = itertools.count(1)


def new_ref(uid: int | None) -> SessionRef:
    n = next(_ids)
    return SessionRef(token=f"token-{n}", public_id=n, client="unit", pid=n, uid=uid)


def layout(sizes: list[int], seed: int = 0) -> tuple[bytes, Manifest]:
    """Random bytes laid out as a client lays tensors out, and the manifest with their digests (the client's)."""
    offsets, size = layout_offsets(sizes)
    data = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    found = hash_views([memoryview(data)[at:at + n] for at, n in zip(offsets, sizes, strict=True)])
    specs = tuple(TensorSpec(f"t{i}", "uint8", (n,), (1,), at, digest)
                  for i, (at, n, digest) in enumerate(zip(offsets, sizes, found, strict=True)))
    return bytes(data), Manifest.digested(specs, {})


def daemon_digest(data: bytes, manifest: Manifest, chunk_bytes: int) -> str:
    """The layout digest as a check computes it: its chunks' leaves, hashed chunk by chunk."""
    chunks = plan_chunks(manifest, chunk_bytes)
    leaves: dict[int, list[tuple[int, bytes]]] = {}
    for chunk in chunks:
        assert chunk.size <= chunk_bytes
        staged = memoryview(data)[chunk.start:chunk.start + chunk.size]
        for (tensor, offset, _), leaf in zip(chunk.leaves, hash_chunk(staged, chunk), strict=True):
            leaves.setdefault(tensor, []).append((offset, leaf))
    found = [digests.from_leaves(leaf for _, leaf in sorted(leaves.get(index, [])))
             for index in range(len(manifest.tensors))]
    return digests.layout_digest((t.name, t.dtype, t.shape, digest)
                                 for t, digest in zip(manifest.tensors, found, strict=True))


SIZES = [5 * LEAF + 3, 7, 0, LEAF, 2 * LEAF - 1, 4096, 3 * LEAF]


@pytest.mark.parametrize("chunk_bytes", [LEAF, 3 * LEAF, 4 * LEAF, 64 * LEAF])
def test_the_chunked_check_computes_the_clients_digest(chunk_bytes: int) -> None:
    data, manifest = layout(SIZES)
    assert manifest.digest is not None
    assert daemon_digest(data, manifest, chunk_bytes) == manifest.digest
    forged = bytearray(data)
    forged[manifest.tensors[0].offset + 4 * LEAF] ^= 1  # one bit of one leaf of the first tensor
    assert daemon_digest(bytes(forged), manifest, chunk_bytes) != manifest.digest


def test_each_leaf_is_in_one_chunk() -> None:
    _, manifest = layout(SIZES)
    chunks = plan_chunks(manifest, 4 * LEAF)
    leaves = [leaf for chunk in chunks for leaf in chunk.leaves]
    assert len(leaves) == len(set(leaves)) == sum(-(-n // LEAF) for n in SIZES)
    assert all(isinstance(chunk, Chunk) and chunk.start <= min(at for _, at, _ in chunk.leaves) for chunk in chunks)


def test_a_strided_tensor_cannot_be_checked() -> None:
    shape = (4, 4)
    specs = (TensorSpec("t", "float32", shape, c_strides(shape)[::-1], 0, "xxh3-128:" + "0" * 32),)
    with pytest.raises(DigestMismatch, match="strides"):
        plan_chunks(Manifest.digested(specs, {}))


# --- a device's checks, on the test thread ------------------------------------------------------------------------


@pytest.fixture
def state() -> Iterator[DeviceState]:
    driver = SimDriver(device_count=1, memory_per_device=256 << 20)
    driver.init()
    yield DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=64 << 20), ShareRegistry(),
                      TicketBook())


def start(state: DeviceState, ref: SessionRef, op: str, payload: tuple[Any, ...] = (), **args: Any) -> Reply | Pending:
    outcome = DEVICE_HANDLERS[op](state, Job(b"peer", 1, OPS[op], decode_args(OPS[op], args), ref, 0, payload))
    assert isinstance(outcome, Reply | Pending)
    return outcome


def finish(outcome: Reply | Pending) -> dict[str, Any]:
    if isinstance(outcome, Pending):
        assert wait_until(outcome.done, timeout=10), "never completed"
        outcome = outcome.then()
    return outcome.result


def publish(state: DeviceState, ref: SessionRef, name: str, data: bytes, manifest: Manifest, **flags: Any) -> int:
    handle = finish(start(state, ref, "alloc", size=len(data), shareable=True))["buffer"]["handle"]
    finish(start(state, ref, "write", (data,), buffer=handle, offset=0))
    finish(start(state, ref, "publish", buffer=handle, name=name, manifest=manifest.pack(), **flags))
    return int(handle)


def undigested(manifest: Manifest) -> Manifest:
    """The manifest as a publisher that hashed nothing states it."""
    return Manifest(tuple(dataclasses.replace(tensor, digest=None) for tensor in manifest.tensors), manifest.metadata)


def background(state: DeviceState) -> None:
    """Move the device's background checks on, as its worker does between requests, until none is left."""
    assert wait_until(lambda: state.digest_checks.advance() or not state.digest_checks.busy(), timeout=10)


def test_a_check_vouches_once_and_a_forgery_is_remembered(state: DeviceState) -> None:
    data, manifest = layout(SIZES)
    digest = manifest.digest
    assert digest is not None
    publisher, other = new_ref(uid=1000), new_ref(uid=2000)
    publish(state, publisher, "real", data, manifest)
    assert finish(start(state, new_ref(uid=1000), "verify_shared", name="real", digest=digest)) == {
        "digest": digest, "verified": "publisher", "hashed": False}
    assert finish(start(state, other, "verify_shared", name="real", digest=digest))["hashed"] is True
    assert finish(start(state, other, "verify_shared", name="real", digest=digest))["hashed"] is False
    publish(state, publisher, "forged", b"\x5a" * len(data), manifest)
    for _ in range(2):  # hashed once, then the verdict
        with pytest.raises(DigestMismatch, match=r"session .* uid 1000"):
            finish(start(state, other, "verify_shared", name="forged", digest=digest))
    assert state.digest_checks.status() == {"checked": 2, "mismatches": 1, "computed": 0,
                                            "bytes_hashed": 2 * sum(SIZES), "running": None, "queued": 0,
                                            "staging_bytes": 0}
    assert [(s["name"], s["verified"]) for s in state.registry.page(NameFilter(), 10)[0]] == [("forged", "mismatch"),
                                                                               ("real", "daemon")]


def test_a_check_keeps_its_share_until_it_ends(state: DeviceState) -> None:
    data, manifest = layout([40 * LEAF])
    assert manifest.digest is not None
    publisher = new_ref(uid=1000)
    handle = publish(state, publisher, "going", data, manifest)
    pending = start(state, new_ref(uid=2000), "verify_shared", name="going", digest=manifest.digest)
    assert isinstance(pending, Pending) and not pending.done()  # the check runs (planned on a helper)
    ((share_id, _),) = state.registry.unpublish("going", publisher)
    state.sharing.forget_name("going", share_id)
    finish(start(state, publisher, "free", buffer=handle))
    assert share_id in state.sharing.shares, "freed under the check's copies"
    assert wait_until(pending.done, timeout=10)
    assert pending.then().result["verified"] == "daemon"
    assert share_id not in state.sharing.shares and state.digest_checks.status()["staging_bytes"] == 0


def test_a_name_gone_before_its_check_starts_is_not_found(state: DeviceState) -> None:
    data, manifest = layout([7])
    assert manifest.digest is not None
    with pytest.raises(CuctxError, match="NOT_FOUND"):
        start(state, new_ref(uid=2), "verify_shared", name="nothing", digest=manifest.digest)
    publish(state, new_ref(uid=1), "small", data, manifest)
    with pytest.raises(DigestMismatch, match="not the required"):
        start(state, new_ref(uid=2), "verify_shared", name="small", digest="xxh3-128:" + "1" * 32)


def test_a_version_without_a_digest_gets_the_one_the_daemon_finds_and_a_reliance_waits_for_it(
        state: DeviceState) -> None:
    data, manifest = layout(SIZES, seed=3)
    publisher, other = new_ref(uid=1000), new_ref(uid=2000)
    publish(state, publisher, "policy", data, undigested(manifest), version=True)
    assert state.digest_checks.busy()
    pending = start(state, other, "verify_shared", name="policy", digest=manifest.digest)
    assert isinstance(pending, Pending)
    assert finish(pending) == {"digest": manifest.digest, "verified": "daemon", "hashed": True}
    descriptor = state.registry.lookup("policy")
    assert descriptor.manifest == manifest.pack() and descriptor.version == 1  # each tensor's digest, the layout's
    assert state.digest_checks.status()["computed"] == 1
    assert [(s["digest"], s["verified"]) for s in state.registry.page(NameFilter(), 10)[0]] == [
        (manifest.digest, "daemon")]
    with pytest.raises(DigestMismatch, match="not the required"):
        start(state, other, "verify_shared", name="policy", digest="xxh3-128:" + "2" * 32)


def test_a_version_with_a_digest_or_a_plain_name_is_not_hashed(state: DeviceState) -> None:
    data, manifest = layout([3 * LEAF], seed=4)
    publish(state, new_ref(uid=1), "stated", data, manifest, version=True)
    publish(state, new_ref(uid=1), "plain", data, undigested(manifest))
    assert not state.digest_checks.busy()


def test_a_version_freed_while_it_is_hashed_is_given_up_and_nothing_is_recorded(state: DeviceState) -> None:
    data, manifest = layout([40 * LEAF], seed=5)
    publisher = new_ref(uid=1000)
    publish(state, publisher, "gone", data, undigested(manifest), version=True)
    share_id = state.registry.lookup("gone").share_id
    state.digest_checks.advance()  # planning starts on a helper
    ((unpublished, _),) = state.registry.unpublish("gone", publisher)
    assert unpublished == share_id
    state.sharing.forget_name("gone", share_id)
    assert share_id in state.sharing.shares, "freed under the running check's copies"
    background(state)
    assert share_id not in state.sharing.shares and state.digest_checks.status()["computed"] == 0


def test_a_versions_digest_holds_still_while_the_device_serves_requests_unless_a_reliance_waits(
        state: DeviceState) -> None:
    data, manifest = layout([8 * LEAF], seed=6)
    publish(state, new_ref(uid=1000), "busy", data, undigested(manifest), version=True)
    for _ in range(200):  # the worker's loop while requests keep coming
        state.digest_checks.advance(idle=False)
    assert state.digest_checks.status()["bytes_hashed"] == 0 and state.digest_checks.busy()
    pending = start(state, new_ref(uid=2000), "verify_shared", name="busy", digest=manifest.digest)
    assert finish(pending)["verified"] == "daemon"  # the reliance's own polls move it on
    assert state.digest_checks.status()["bytes_hashed"] == len(data)
