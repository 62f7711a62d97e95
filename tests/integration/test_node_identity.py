"""What a node's daemon tells a cluster: ``cuctx status --json`` and the metrics name the node and
every device's UUID, so that monitoring can tell one node's daemon from another's (issue 30)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from cuctxd.client import Client
from tests.helpers import DaemonProcess, cuctx, cuctxd, remove_tempdir, start_daemon
from tests.integration.test_service_metrics import free_port, scrape

NODE = "gpu-node-7"


@pytest.fixture(scope="module")
def node_daemon() -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon told its node's name, as the DaemonSet does (``--node-name $(NODE_NAME)``), with metrics on."""
    for _ in range(3):
        port = free_port()
        try:
            process = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB", "--node-name", NODE,
                                   "--metrics-port", str(port), ready_timeout=15)
        except AssertionError as exc:
            if "metrics on 127.0.0.1" in str(exc):
                continue  # the port was taken between the probe and the daemon's bind
            raise
        break
    else:
        raise AssertionError("no free port for the metrics endpoint in 3 tries")
    yield process, f"http://127.0.0.1:{port}/metrics"
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, process.log()


def test_status_json_names_the_node_and_every_device_uuid(node_daemon: tuple[DaemonProcess, str]) -> None:
    process, _ = node_daemon
    done = cuctx("--endpoint", process.endpoint, "status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["node"] == NODE
    with Client(process.endpoint, timeout=10) as client:
        uuids = [device.uuid for device in client.devices()]
    assert [device["uuid"] for device in status["devices"]] == uuids
    assert all(uuid.startswith("GPU-") for uuid in uuids)


def test_the_metrics_name_the_node_and_every_device_uuid(node_daemon: tuple[DaemonProcess, str]) -> None:
    process, url = node_daemon
    samples = scrape(url)
    info = [dict(labels) for (name, labels) in samples if name == "cuctxd_info"]
    assert [labels["node"] for labels in info] == [NODE]
    with Client(process.endpoint, timeout=10) as client:
        devices = client.devices()
    for index, device in enumerate(devices):
        labels = {"device": str(index), "ordinal": str(index), "name": device.name, "uuid": device.uuid,
                  "pci_bus_id": device.pci_bus_id, "node": NODE}
        assert samples.get(("cuctxd_device_info", tuple(sorted(labels.items())))) == 1, labels


def test_the_node_defaults_to_the_host_name(daemon: DaemonProcess, client: Client) -> None:
    assert client.status()["node"] == socket.gethostname()


def test_a_node_name_must_not_be_empty() -> None:
    done = cuctxd("--node-name", "", "--print-config")
    assert done.returncode == 2 and "--node-name: must be a non-empty string" in done.stderr, done.stderr
