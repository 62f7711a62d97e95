"""The Prometheus endpoint of a real daemon, read with a plain HTTP GET."""

from __future__ import annotations

import dataclasses
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cuctxd.client import Client, UnknownHandle
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon, wait_until

MiB = 1 << 20
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_daemon() -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with metrics on; the port is picked free and retried if someone takes it first."""
    for _ in range(3):
        port = free_port()
        try:
            process = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB", "--lease-ttl", "0.6",
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


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_requests_are_counted_by_op_and_outcome(metrics_daemon: tuple[DaemonProcess, str]) -> None:
    process, url = metrics_daemon
    before = scrape(url)
    with Client(process.endpoint, timeout=10) as client:
        buffer = client.alloc(MiB, device=1)
        buffer.fill(3)
        bogus = type(buffer)(client, dataclasses.replace(buffer.record, handle=buffer.handle + 1))
        with pytest.raises(UnknownHandle):
            bogus.fill(1)
        client.ping()
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("cuctxd_requests_total", op="alloc", outcome="ok") == 1
    assert delta("cuctxd_requests_total", op="fill", outcome="ok") == 1
    assert delta("cuctxd_requests_total", op="fill", outcome="CUCTXD_ERROR_UNKNOWN_HANDLE") == 1
    assert delta("cuctxd_requests_total", op="hello", outcome="ok") >= 1
    assert delta("cuctxd_request_duration_seconds_count", op="alloc") == 1
    assert delta("cuctxd_request_duration_seconds_count", op="fill") == 2
    assert 0 < delta("cuctxd_request_duration_seconds_sum", op="alloc") < 5
    assert delta("cuctxd_request_duration_seconds_bucket", op="ping", le="+Inf") >= 1
    assert delta("cuctxd_sessions_opened_total") >= 1
    assert delta("cuctxd_sessions_closed_total") >= 1


def test_devices_and_sessions_are_shown(metrics_daemon: tuple[DaemonProcess, str]) -> None:
    process, url = metrics_daemon
    with Client(process.endpoint, timeout=10) as client:
        client.alloc(3 * MiB, device=1)
        client.alloc(MiB, device=1)
        samples = scrape(url)
        assert value(samples, "cuctxd_sessions") >= 1
        assert value(samples, "cuctxd_device_up", device="1") == 1
        assert value(samples, "cuctxd_device_allocations", device="1") == 2
        assert value(samples, "cuctxd_device_allocated_bytes", device="1") == 4 * MiB
        assert value(samples, "cuctxd_device_contexts", device="1") == 1
        assert value(samples, "cuctxd_device_shm_lanes", device="1") == 1  # the client's, opened by its alloc
        assert value(samples, "cuctxd_client_fds") >= 5  # that lane's 4 and the client's fd channel connection
        assert 0 < value(samples, "cuctxd_client_fds_max_per_peer") < value(samples, "cuctxd_client_fds_max")
        assert value(samples, "cuctxd_fd_channel_connections") >= 1
        assert value(samples, "cuctxd_device_memory_total_bytes", device="1") == 64 * MiB
        used = value(samples, "cuctxd_device_memory_used_bytes", device="1")
        free = value(samples, "cuctxd_device_memory_free_bytes", device="1")
        assert used >= 4 * MiB and used + free == 64 * MiB
        assert ("cuctxd_device_memory_free_bytes", (("device", "0"),)) not in samples  # no context there
        assert value(samples, "cuctxd_device_allocations", device="0") == 0
        info = [labels for (name, labels) in samples if name == "cuctxd_device_info"]
        assert sorted(dict(labels)["ordinal"] for labels in info) == ["0", "1"]
        assert value(samples, "cuctxd_info", version=client.daemon_version, protocol=str(client.protocol),
                     backend="sim", node=socket.gethostname()) == 1
    assert value(scrape(url), "cuctxd_device_allocations", device="1") == 0  # freed with the session
    assert value(samples, "cuctxd_draining") == 0


def test_reaped_sessions_are_counted(metrics_daemon: tuple[DaemonProcess, str]) -> None:
    process, url = metrics_daemon
    before = value(scrape(url), "cuctxd_sessions_reaped_total")
    client = Client(process.endpoint, timeout=10, heartbeat=False)
    try:
        reaped = wait_until(lambda: value(scrape(url), "cuctxd_sessions_reaped_total") >= before + 1, 10, 0.1)
        assert reaped, "the session was never reaped"
    finally:
        client.close()
