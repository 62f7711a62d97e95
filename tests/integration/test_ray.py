"""cuctxd.client.ray_nodes on a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), each
with its own sim daemon, one of them with none.

Each Ray node is started with ``CUCTXD_ENDPOINT`` in its environment (``env_vars``), which its raylet
hands to every worker it starts: the convention cuctxd.client.ray_nodes documents. On a real cluster that is one
socket path on every node (the DaemonSet's); here the nodes share one host, so each gets its own.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'cuctxd[ray]' to run the Ray tests")
np = pytest.importorskip("numpy")
save_file = pytest.importorskip("safetensors.numpy").save_file

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import cuctxd.client.ray_nodes as cuctxd_ray  # noqa: E402
from cuctxd import Client, NotFound  # noqa: E402
from cuctxd.client.tensors.copies import SIM_VISIBLE_DEVICES  # noqa: E402
from cuctxd.protos.endpoints import ENDPOINT_ENV  # noqa: E402
from tests.checkpoint_files import write_index  # noqa: E402
from tests.helpers import DaemonProcess, remove_tempdir, short_tempdir, start_daemon  # noqa: E402


@dataclass
class RayNodes:
    """The cluster, its nodes' endpoints by node id, and the daemons behind them (None: no daemon)."""

    cluster: Any
    endpoints: dict[str, str]
    daemons: dict[str, DaemonProcess | None]

    def with_daemon(self) -> list[str]:
        return [node for node, daemon in self.daemons.items() if daemon is not None]


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    """Three Ray nodes: the head and one more with a daemon of two sim devices each, a third whose socket has
    none."""
    daemons = [start_daemon("--sim-devices", "2", "--sim-memory", "64MiB") for _ in range(2)]
    empty = short_tempdir()
    endpoints = [daemons[0].endpoint, daemons[1].endpoint, f"ipc://{empty}/none.sock"]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "env_vars": {ENDPOINT_ENV: endpoints[0]}})
    try:
        added = [cluster.head_node, *(cluster.add_node(num_cpus=1, env_vars={ENDPOINT_ENV: endpoint})
                                      for endpoint in endpoints[1:])]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        ids = [node.node_id for node in added]
        yield RayNodes(cluster, dict(zip(ids, endpoints, strict=True)),
                       dict(zip(ids, [*daemons, None], strict=True)))
    finally:
        ray.shutdown()
        cluster.shutdown()
        for daemon in daemons:
            code = daemon.stop()
            remove_tempdir(daemon.socket_dir)
            assert code == 0, daemon.log()
        remove_tempdir(empty)


def weights(seed: int) -> dict[str, Any]:
    return {f"layer{seed}.w": np.arange(256, dtype=np.float32) + seed,
            f"layer{seed}.b": np.full((4, 4), seed, dtype=np.int16)}


def by_node(results: list[cuctxd_ray.NodeResult]) -> dict[str, cuctxd_ray.NodeResult]:
    assert len({r.node_id for r in results}) == len(results)
    return {r.node_id: r for r in results}


def test_publish_on_every_node_reports_each_node(nodes: RayNodes, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(weights(1), str(path))
    results = by_node(cuctxd_ray.publish_on_every_node(path, "ray-file", timeout=45))
    assert set(results) == set(nodes.endpoints)
    for node, result in results.items():
        assert result.endpoint == nodes.endpoints[node]  # each task reached its own node's daemon
        if nodes.daemons[node] is None:
            assert (result.ok, result.error_type, result.layouts) == (False, "NoDaemon", ())
        else:
            assert result.ok and result.layouts == ("ray-file",) and result.nbytes >= path.stat().st_size - 200
    for node in nodes.with_daemon():
        with Client(nodes.endpoints[node], timeout=10) as client:
            listed = {entry["name"]: entry for entry in client.list_shared()}
            assert [copy["device"] for copy in listed["ray-file"]["copies"]] == [0, 1]  # every GPU of the node
    removed = by_node(cuctxd_ray.unpublish_on_every_node(["ray-file"], timeout=30))
    for node in nodes.with_daemon():
        assert removed[node].layouts == ("ray-file",)
        with Client(nodes.endpoints[node], timeout=10) as client, pytest.raises(NotFound):
            client.lookup("ray-file")


@ray.remote(num_cpus=0)
class Reader:
    """An actor that opens the node's layouts locally (each the copy on its own device) and reports what it sees."""

    def __init__(self, layouts: list[str]) -> None:
        self.local = cuctxd_ray.LocalLayouts(layouts)

    def read(self) -> tuple[str, list[int], dict[str, tuple[tuple[int, ...], bytes]]]:
        return (self.local.client.endpoint, [opened.share.device for opened in self.local.layouts.values()],
                {key: (tensor.shape, bytes(np.asarray(tensor).tobytes())) for key, tensor in self.local.items()})

    def close(self) -> None:
        self.local.close()


def test_a_directory_is_one_layout_through_its_index_and_actors_open_their_gpus_copy(nodes: RayNodes,
                                                                                     tmp_path: Path) -> None:
    """As ``cuctx load``: a sharded directory is one layout through its index, on every GPU of each node; an actor
    that sees one device (``CUCTXD_SIM_VISIBLE_DEVICES``, the sim's ``CUDA_VISIBLE_DEVICES``) opens its copy."""
    for shard in (1, 2):
        save_file(weights(shard), str(tmp_path / f"model-0000{shard}-of-00002.safetensors"))
    write_index(tmp_path / "model.safetensors.index.json",
                {key: f"model-0000{shard}-of-00002.safetensors" for shard in (1, 2) for key in weights(shard)})
    (tmp_path / "config.json").write_text("{}")
    names = cuctxd_ray.layout_names(tmp_path, "ray-dir")
    assert names == ["ray-dir"]
    results = by_node(cuctxd_ray.publish_on_every_node(tmp_path, "ray-dir", read_only=True, timeout=45))
    expected = {key: (value.shape, value.tobytes()) for shard in (1, 2) for key, value in weights(shard).items()}
    for node in nodes.with_daemon():
        assert results[node].layouts == tuple(names)
        reader = Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                                runtime_env={"env_vars": {SIM_VISIBLE_DEVICES: "1"}}).remote(names)
        endpoint, devices, seen = ray.get(reader.read.remote(), timeout=60)
        assert endpoint == nodes.endpoints[node] and devices == [1]
        assert seen == expected
        ray.get(reader.close.remote(), timeout=30)
        ray.kill(reader)
    assert all(r.ok for r in cuctxd_ray.unpublish_on_every_node(names, node_ids=nodes.with_daemon(), timeout=30))


def test_a_node_holds_all_ranks_or_none(nodes: RayNodes, tmp_path: Path) -> None:
    save_file(weights(1), str(tmp_path / "model-rank-0-part-0.safetensors"))
    (tmp_path / "model-rank-1-part-0.safetensors").write_bytes(
        (tmp_path / "model-rank-0-part-0.safetensors").read_bytes()[:-8])  # truncated
    assert cuctxd_ray.layout_names(tmp_path, "ray-half") == ["ray-half/rank-0", "ray-half/rank-1"]
    results = by_node(cuctxd_ray.publish_on_every_node(tmp_path, "ray-half", node_ids=nodes.with_daemon(),
                                                       timeout=45))
    assert set(results) == set(nodes.with_daemon())
    for node, result in results.items():
        assert (result.error_type, result.layouts) == ("BadArgument", ()), result
        with Client(nodes.endpoints[node], timeout=10) as client, pytest.raises(NotFound):
            client.lookup("ray-half/rank-0")


def test_other_content_under_an_existing_name_fails_its_node_unless_replaced(nodes: RayNodes, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(weights(3), str(path))
    only = nodes.with_daemon()
    assert all(r.ok for r in cuctxd_ray.publish_on_every_node(path, "ray-again", node_ids=only, timeout=45))
    same = cuctxd_ray.publish_on_every_node(path, "ray-again", node_ids=only, timeout=45)
    assert all(r.ok for r in same), same  # the same content: left as it is
    save_file(weights(5), str(path))
    again = cuctxd_ray.publish_on_every_node(path, "ray-again", node_ids=only, timeout=45)
    assert [r.error_type for r in again] == ["NameExists"] * len(only), again
    replaced = cuctxd_ray.publish_on_every_node(path, "ray-again", node_ids=only, replace=True, timeout=45)
    assert all(r.ok and r.layouts == ("ray-again",) for r in replaced)
    cuctxd_ray.unpublish_on_every_node(["ray-again"], node_ids=only, timeout=30)


def test_a_hung_daemon_is_reported_not_waited_for(nodes: RayNodes, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(weights(4), str(path))
    hung = nodes.with_daemon()[1]
    daemon = nodes.daemons[hung]
    assert daemon is not None
    os.kill(daemon.process.pid, signal.SIGSTOP)  # its socket still accepts; nothing answers
    try:
        started = time.monotonic()
        results = by_node(cuctxd_ray.publish_on_every_node(path, "ray-hung", timeout=4))
        took = time.monotonic() - started
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert took < 15, f"publish_on_every_node took {took:.1f} s with a 4 s timeout"
    assert results[hung].error_type in {"Timeout", "DaemonTimeout"}, results[hung]
    kinds = {node: r.error_type for node, r in results.items() if node != hung}
    assert sorted(kinds.values(), key=str) == sorted([None, "NoDaemon"], key=str), kinds
    cuctxd_ray.unpublish_on_every_node(["ray-hung"], timeout=30)
