"""Tensors by name through a real daemon: a layout published by a process that then exits, mapped as
numpy views by others; bad manifests refused with nothing published."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest

from cuctxd import BadArgument, Client, NameExists, NotFound
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.safetensors_load import load_safetensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.client.wire import build
from tests.helpers import DaemonProcess, cuctx, run_client


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "64MiB")


PRODUCER = """
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors.publishing import publish_tensors
with Client(ENDPOINT) as c:
    publish_tensors(c, "toy-model", {
        "embed.weight": np.arange(4 * 8, dtype=np.float32).reshape(4, 8),
        "norm.bias": np.full(8, 0.5, dtype=np.float16),
        "step": np.array([3], dtype=np.int64),
        "mask": np.array([True, False, True]),
    }, {"arch": "toy", "layers": 1})
"""

CONSUMER = """
import numpy as np
from cuctxd import Client
from cuctxd.client.tensors.tensor_sets import open_tensors
with Client(ENDPOINT) as c, open_tensors(c, "toy-model") as ts:
    w = np.asarray(ts["embed.weight"])
    print(sorted(ts), ts.metadata["arch"], w.shape, float(w.sum()), np.asarray(ts["norm.bias"]).dtype,
          np.asarray(ts["mask"]).tolist(), int(np.asarray(ts["step"])[0]))
"""


def test_a_layout_outlives_its_producer_and_maps_as_numpy_views(daemon: DaemonProcess) -> None:
    run_client(PRODUCER, daemon.endpoint)
    with Client(daemon.endpoint) as c:
        (listed,) = [s for s in c.list_shared() if s["name"] == "toy-model"]
        assert listed["tensors"] == 4 and not listed["owner_present"]
        with open_tensors(c, "toy-model") as ts:  # held: the consumer process below maps it too
            first = np.asarray(ts["embed.weight"])
            assert (first.ctypes.data - ts.host_address) % 256 == 0  # tensors start on 256-byte boundaries
            with pytest.raises(KeyError, match="no tensor 'missing'"):
                ts["missing"]
            del first
            out = run_client(CONSUMER, daemon.endpoint).strip()
        assert out == "['embed.weight', 'mask', 'norm.bias', 'step'] toy (4, 8) 496.0 float16 [True, False, True] 3"


def test_views_share_the_daemons_bytes(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as owner, Client(daemon.endpoint) as other:
        publish_tensors(owner, "shared-bytes", {"x": np.zeros(16, dtype=np.int32)})
        with open_tensors(other, "shared-bytes", writable=True) as ts:
            np.asarray(ts["x"])[3] = 42
            with open_tensors(owner, "shared-bytes") as again:
                assert int(np.asarray(again["x"])[3]) == 42
        owner.unpublish("shared-bytes")


def test_many_small_tensors_land_intact_through_the_staging_ring(daemon: DaemonProcess) -> None:
    """Hundreds of tensors share ring slots (one DMA spans many), and one of 20 MiB spans two slots."""
    rng = np.random.default_rng(7)
    tensors = {f"t{i}": rng.integers(0, 255, size=int(rng.integers(1, 9000)), dtype=np.uint8) for i in range(300)}
    tensors["big"] = rng.integers(0, 255, size=20 << 20, dtype=np.uint8)
    with Client(daemon.endpoint) as c:
        reports: list[tuple[int, int]] = []
        publish_tensors(c, "many-small", tensors, progress=lambda done, total: reports.append((done, total)))
        total = sum(t.nbytes for t in tensors.values())
        assert reports[-1] == (total, total)
        with open_tensors(c, "many-small") as ts:
            assert all(np.array_equal(np.asarray(ts[key]), value) for key, value in tensors.items())
        c.unpublish("many-small")


@pytest.mark.parametrize(("manifest", "message"), [
    ({"tensors": [{"name": "a", "dtype": "float128", "shape": [1], "offset": 0}]}, "unknown dtype"),
    ({"tensors": [{"name": "a", "dtype": "float32", "shape": [2048], "offset": 0}]}, "past the 4096-byte buffer"),
    ({"tensors": [{"name": "a", "dtype": "int8", "shape": [1], "offset": 0},
                  {"name": "a", "dtype": "int8", "shape": [1], "offset": 1}]}, "appears twice"),
    ({"tensors": [{"name": "a", "dtype": "int32", "shape": [1], "offset": 2}]}, "not a multiple"),
    ({"tensors": [{"name": "a", "dtype": "int8", "shape": [-1], "offset": 0}]}, "non-negative"),
    ({"tensors": "nope"}, "a 'tensors' list"),
])
def test_a_bad_manifest_publishes_nothing(daemon: DaemonProcess, manifest: object, message: str) -> None:
    with Client(daemon.endpoint) as c:
        buf = c.alloc(4096, shareable=True)
        with pytest.raises(BadArgument, match=message):
            c.run(build.publish(buf, "bad-layout", msgpack.packb(manifest)))
        with pytest.raises(NotFound):
            c.lookup("bad-layout")
        assert buf.export().share_id not in {s["share_id"] for s in c.list_shared()}


def test_garbage_instead_of_a_manifest_is_refused(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c, pytest.raises(BadArgument, match=r"not msgpack|'tensors' list"):
        c.run(build.publish(c.alloc(64, shareable=True), "garbage-layout", b"\xc1\xff\x00"))


def test_a_taken_name_leaves_nothing_allocated(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as first, Client(daemon.endpoint) as second:
        publish_tensors(first, "taken", {"a": np.ones(4, dtype=np.float32)})
        with pytest.raises(NameExists):
            publish_tensors(second, "taken", {"a": np.ones(1 << 16, dtype=np.float32)})
        (mine,) = [s for s in second.status()["devices"][0]["sessions"] if s["session"] == second.session_id]
        assert mine["bytes"] == 0
        first.unpublish("taken")


def test_a_plain_buffer_is_not_a_layout(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint) as c:
        c.publish(c.alloc(64, shareable=True), "plain")
        with pytest.raises(BadArgument, match="without a tensor layout"):
            open_tensors(c, "plain")
        c.unpublish("plain")


def test_dlpack_views_on_the_sim_are_zero_copy_host_arrays(daemon: DaemonProcess) -> None:
    import gc

    from cuctxd.client.tensors import dlpack

    with Client(daemon.endpoint) as c:
        publish_tensors(c, "dlpack-model", {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
        with open_tensors(c, "dlpack-model", writable=True) as ts:
            assert ts["w"].__dlpack_device__() == (dlpack.KDL_CPU, 0)
            view = np.from_dlpack(ts["w"])
            assert view.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
            np.asarray(ts["w"])[0, 0] = 99.0
            assert float(view[0, 0]) == 99.0  # one memory
            unconsumed = ts["w"].__dlpack__()
            with pytest.raises(BufferError):
                ts["w"].__dlpack__(copy=True)
            kept = len(dlpack._alive)
            del unconsumed
            gc.collect()
            assert len(dlpack._alive) == kept - 1, "a capsule nobody consumed lets its tensor go"
            del view
            gc.collect()
            assert len(dlpack._alive) == kept - 2, "the consumer's deleter lets its tensor go"
        c.unpublish("dlpack-model")


def _safetensors_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from safetensors.numpy import save_file

    tensors = {"embed": np.arange(64, dtype=np.float32).reshape(8, 8), "bias": np.ones(5, dtype=np.float16),
               "ids": np.arange(3, dtype=np.int64)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    return path, tensors


def test_cuctx_load_publishes_a_safetensors_file(daemon: DaemonProcess, tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="the safetensors package reads the format")
    path, tensors = _safetensors_file(tmp_path)
    done = cuctx("--endpoint", daemon.endpoint, "load", str(path), "--name", "from-disk")
    assert done.returncode == 0, done.stderr
    assert "published" in done.stdout and "'from-disk'" in done.stdout
    with Client(daemon.endpoint) as c, open_tensors(c, "from-disk") as ts:
        assert ts.metadata == {"format": "np"}
        for key, value in tensors.items():
            assert np.asarray(ts[key]).tolist() == value.tolist(), key
        shared = cuctx("--endpoint", daemon.endpoint, "shared")
        assert re.search(r"from-disk +0 +.* 3 +rw ", shared.stdout), shared.stdout
        c.unpublish("from-disk")


def test_a_read_only_layout_is_mapped_read_only_and_refuses_writable_opens(daemon: DaemonProcess,
                                                                           tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="the safetensors package reads the format")
    path, tensors = _safetensors_file(tmp_path)
    done = cuctx("--endpoint", daemon.endpoint, "load", str(path), "--name", "frozen", "--read-only")
    assert done.returncode == 0, done.stderr
    with Client(daemon.endpoint) as c:
        descriptor = c.lookup("frozen")
        assert descriptor.read_only
        (listed,) = [s for s in c.list_shared() if s["name"] == "frozen"]
        assert listed["read_only"] and listed["tensors"] == 3
        assert re.search(r"frozen +0 +.* 3 +ro ", cuctx("--endpoint", daemon.endpoint, "shared").stdout)
        with pytest.raises(BadArgument, match="published read-only"):
            open_tensors(c, "frozen", writable=True)
        with open_tensors(c, "frozen") as ts:
            embed = np.asarray(ts["embed"])
            assert embed.tolist() == tensors["embed"].tolist() and not embed.flags.writeable
        with c.open_shared(descriptor) as share:
            assert share.host_view().readonly
        c.unpublish("frozen")
        buf = c.alloc(64, shareable=True)
        assert not c.publish(buf, "plain").read_only and not c.lookup("plain").read_only
        assert c.publish(buf, "plain-ro", read_only=True).read_only and c.lookup("plain-ro").read_only
        c.unpublish("plain")
        c.unpublish("plain-ro")


@pytest.mark.parametrize("damage", ["truncated", "lying header"])
def test_a_damaged_safetensors_file_publishes_nothing(daemon: DaemonProcess, tmp_path: Path, damage: str) -> None:
    pytest.importorskip("safetensors", reason="the safetensors package reads the format")
    path, _ = _safetensors_file(tmp_path)
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-100])
    else:
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        header["embed"]["data_offsets"][1] += 4096
        packed = json.dumps(header).encode().ljust(length)
        path.write_bytes(raw[:8] + packed[:length] + raw[8 + length:]) if len(packed) == length else \
            path.write_bytes(struct.pack("<Q", len(packed)) + packed + raw[8 + length:])
    with Client(daemon.endpoint) as c:
        with pytest.raises(BadArgument):
            load_safetensors(c, str(path), "damaged")
        with pytest.raises(NotFound):
            c.lookup("damaged")
        mine = [s for s in c.status()["devices"][0]["sessions"] if s["session"] == c.session_id]
        assert all(s["bytes"] == 0 for s in mine), "the damaged file left memory allocated"


def test_a_persistent_layout_survives_its_consumers_until_unpublished(daemon: DaemonProcess) -> None:
    run_client(PRODUCER.replace("toy-model", "weights-for-restarts"), daemon.endpoint)
    for _ in range(2):  # a worker that restarts: open, close, open again
        assert "toy (4, 8)" in run_client(CONSUMER.replace("toy-model", "weights-for-restarts"), daemon.endpoint)
    with Client(daemon.endpoint) as c:
        (listed,) = [s for s in c.list_shared() if s["name"] == "weights-for-restarts"]
        share_prefix = listed["share_id"][:8]
        c.unpublish("weights-for-restarts")
        assert all(s["share_id"] != share_prefix for s in c.status()["devices"][0]["shares"])


def test_a_layout_that_is_not_persistent_also_stays_for_every_consumer(daemon: DaemonProcess) -> None:
    """One lifetime rule for plain buffers and layouts: opening does not consume a name; only the orphan
    TTL (not for persistent ones) or an unpublish ends it."""
    producer = PRODUCER.replace("toy-model", "not-persistent").replace("{\"arch\": \"toy\", \"layers\": 1})",
                                                                       "{\"arch\": \"toy\"}, persistent=False)")
    run_client(producer, daemon.endpoint)
    for _ in range(2):
        assert "toy (4, 8)" in run_client(CONSUMER.replace("toy-model", "not-persistent"), daemon.endpoint)
    with Client(daemon.endpoint) as c:
        c.unpublish("not-persistent")
        with pytest.raises(NotFound):
            c.lookup("not-persistent")


def test_the_array_adapter_gives_read_only_numpy_views_on_the_sim(daemon: DaemonProcess) -> None:
    from cuctxd.client.tensors.cupy_arrays import load_arrays, publish_arrays

    with Client(daemon.endpoint) as c:
        publish_arrays(c, "arrays", {"a": np.arange(6, dtype=np.int32).reshape(2, 3)}, {"v": 1})
        with load_arrays(c, "arrays") as loaded:
            assert loaded.arrays["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and loaded.metadata == {"v": 1}
            with pytest.raises(ValueError, match="read-only"):
                loaded.arrays["a"][0, 0] = 7
        with load_arrays(c, "arrays", writable=True) as loaded:
            loaded.arrays["a"][0, 0] = 7
        with load_arrays(c, "arrays") as loaded:
            assert int(loaded.arrays["a"][0, 0]) == 7
        c.unpublish("arrays")


def test_loading_other_content_under_a_taken_name_says_so_and_closes_the_files(daemon: DaemonProcess,
                                                                               tmp_path: Path) -> None:
    """The refusal comes back as itself, not as a BufferError from closing the files' mappings (hashed to
    compare) while the error's traceback still held views of them."""
    pytest.importorskip("safetensors", reason="the safetensors package reads the format")
    path, _ = _safetensors_file(tmp_path)
    with Client(daemon.endpoint, timeout=10) as client:
        client.run(build.publish(client.alloc(64, shareable=True), "taken-by-load"))
        with pytest.raises(NameExists, match=r"without a content digest.*--replace"):
            load_safetensors(client, str(path), "taken-by-load")
        client.unpublish("taken-by-load")
