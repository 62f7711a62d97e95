"""The device plugin (``cuctxd-device-plugin``, a real process) against a fake kubelet that speaks the device
plugin API v1beta1 over Unix sockets with grpcio: it registers, lists its client slots (healthy only while the
daemon's socket exists), hands each container the socket directory read-only and ``CUCTXD_ENDPOINT``, and
registers again when the kubelet restarts (its socket removed)."""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, client_env, remove_tempdir, short_tempdir, wait_until

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (the kubernetes extra, in the test extra)")
api = pytest.importorskip("cuctxd.daemon.kubelet.deviceplugin_v1beta1_pb2")
rpc = pytest.importorskip("cuctxd.daemon.kubelet.deviceplugin_v1beta1_pb2_grpc")
pr_api = pytest.importorskip("cuctxd.daemon.kubelet.podresources_v1_pb2")
pr_rpc = pytest.importorskip("cuctxd.daemon.kubelet.podresources_v1_pb2_grpc")
from tests.kubelet_fakes import Pod, kubelet  # noqa: E402

SLOTS = 4


class FakeKubelet(rpc.RegistrationServicer):  # type: ignore[misc]
    """The kubelet's Registration service: every RegisterRequest goes on :attr:`registered`."""

    def __init__(self) -> None:
        self.registered: queue.Queue[Any] = queue.Queue()

    def Register(self, request: Any, context: Any) -> Any:
        self.registered.put(request)
        return api.Empty()


class Node:
    def __init__(self, root: Path) -> None:
        self.kubelet_dir = root / "device-plugins"
        self.socket_dir = root / "run-cuctxd"
        self.kubelet_dir.mkdir()
        self.socket_dir.mkdir()
        self.kubelet = FakeKubelet()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        rpc.add_RegistrationServicer_to_server(self.kubelet, self.server)
        self.server.add_insecure_port(f"unix:{self.kubelet_dir / 'kubelet.sock'}")
        self.server.start()
        self.plugin = subprocess.Popen(
            [sys.executable, "-m", "cuctxd.daemon.kubelet.device_plugin", "--kubelet-dir", str(self.kubelet_dir),
             "--socket-dir", str(self.socket_dir), "--container-dir", "/run/cuctxd", "--slots", str(SLOTS)],
            env=client_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def registration(self) -> Any:
        try:
            return self.kubelet.registered.get(timeout=30)
        except queue.Empty:
            raise AssertionError("the plugin did not register with the kubelet") from None

    def plugin_channel(self, endpoint: str) -> Any:
        return grpc.insecure_channel(f"unix:{self.kubelet_dir / endpoint}")


@pytest.fixture
def node() -> Iterator[Node]:
    root = short_tempdir()
    made = Node(root)
    try:
        yield made
    finally:
        if made.plugin.poll() is None:
            made.plugin.send_signal(signal.SIGTERM)
        made.plugin.communicate(timeout=20)
        made.server.stop(None)
        remove_tempdir(root)


def test_the_plugin_registers_lists_its_slots_and_allocates_the_socket(node: Node) -> None:
    request = node.registration()
    assert (request.version, request.resource_name) == ("v1beta1", "cuctxd.io/client")
    assert not request.options.pre_start_required
    with node.plugin_channel(request.endpoint) as channel:
        plugin = rpc.DevicePluginStub(channel)
        assert not plugin.GetDevicePluginOptions(api.Empty(), timeout=10).pre_start_required
        stream = plugin.ListAndWatch(api.Empty(), timeout=60)
        first = next(stream)
        assert [d.ID for d in first.devices] == [f"client-{n}" for n in range(SLOTS)]
        assert {d.health for d in first.devices} == {"Unhealthy"}, "no daemon socket yet"
        daemon_socket = socket.socket(socket.AF_UNIX)
        daemon_socket.bind(str(node.socket_dir / "cuctxd.sock"))
        try:
            assert {d.health for d in next(stream).devices} == {"Healthy"}
        finally:
            daemon_socket.close()
            stream.cancel()
        answer = plugin.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["client-0"]),
            api.ContainerAllocateRequest(devices_ids=["client-1", "client-2"])]), timeout=10)
    assert len(answer.container_responses) == 2
    for container in answer.container_responses:
        assert dict(container.envs) == {"CUCTXD_ENDPOINT": "ipc:///run/cuctxd/cuctxd.sock"}
        assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == [
            (str(node.socket_dir), "/run/cuctxd", True)]
        assert not container.devices, "no device nodes: the GPUs come from nvidia.com/gpu"


def test_the_plugin_registers_again_when_the_kubelet_restarts_and_stops_on_sigterm(node: Node) -> None:
    request = node.registration()
    plugin_socket = node.kubelet_dir / request.endpoint
    plugin_socket.unlink()  # what a restarting kubelet does to every plugin socket
    again = node.registration()
    assert (again.endpoint, again.resource_name) == (request.endpoint, request.resource_name)
    assert wait_until(plugin_socket.exists, 10)
    with node.plugin_channel(again.endpoint) as channel:
        assert not rpc.DevicePluginStub(channel).GetDevicePluginOptions(api.Empty(), timeout=10).pre_start_required
    node.plugin.send_signal(signal.SIGTERM)
    _, err = node.plugin.communicate(timeout=20)
    assert node.plugin.returncode == 0, err
    assert "registered cuctxd.io/client" in err and "the kubelet restarted" in err, err


def test_without_a_kubelet_the_plugin_exits_saying_so() -> None:
    root = short_tempdir()
    try:
        done = subprocess.run([sys.executable, "-m", "cuctxd.daemon.kubelet.device_plugin", "--kubelet-dir",
                               str(root), "--socket-dir", str(root)], env=client_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    finally:
        remove_tempdir(root)
    assert done.returncode != 0
    assert "kubelet" in done.stderr.splitlines()[-1], done.stderr


def test_the_plugin_relays_podresources_to_a_daemon_that_is_not_root() -> None:
    root = short_tempdir()
    pods = [Pod("team-a", "client-a", {"main": {"nvidia.com/gpu": ["GPU-1"]}})]
    (root / "device-plugins").mkdir()
    (root / "shared").mkdir()
    relayed = root / "shared" / "pod-resources.sock"
    try:
        with kubelet(root / "pod-resources.sock", "node-a", pods) as (resources, _), \
                node_with_relay(root, relayed) as fake_kubelet:
            fake_kubelet.registered.get(timeout=30)
            assert wait_until(relayed.exists, 10)
            assert oct(relayed.stat().st_mode & 0o777) == oct(0o666)
            for _ in range(3):  # one connection each, as the daemon makes them
                with grpc.insecure_channel(f"unix:{relayed}") as channel:
                    listed = pr_rpc.PodResourcesListerStub(channel).List(pr_api.ListPodResourcesRequest(), timeout=10)
                assert [(p.namespace, p.name) for p in listed.pod_resources] == [("team-a", "client-a")]
                assert list(listed.pod_resources[0].containers[0].devices[0].device_ids) == ["GPU-1"]
            assert resources.calls == 3
    finally:
        remove_tempdir(root)


@contextlib.contextmanager
def node_with_relay(root: Path, relayed: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    rpc.add_RegistrationServicer_to_server(fake, server)
    server.add_insecure_port(f"unix:{root / 'device-plugins' / 'kubelet.sock'}")
    server.start()
    plugin = subprocess.Popen(
        [sys.executable, "-m", "cuctxd.daemon.kubelet.device_plugin", "--kubelet-dir", str(root / "device-plugins"),
         "--socket-dir", str(root), "--relay-pod-resources", str(relayed),
         "--pod-resources-socket", str(root / "pod-resources.sock")],
        env=client_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield fake
    finally:
        plugin.send_signal(signal.SIGTERM)
        _, err = plugin.communicate(timeout=20)
        server.stop(None)
        assert plugin.returncode == 0, err
