"""``gpu_limit`` end to end: a real daemon asks a fake kubelet (PodResources v1 over grpcio) and a fake API
server which GPUs a client's pod holds, the client being a real process placed in a pod's cgroup made here, in
a PID namespace of its own (``unshare --pid --fork``: no hostPID, nothing shared with the daemon's), served over
the socket and the fd channel, its preloaded weights included, and refused, by name, on the GPU its pod lacks;
and, while the API server holds its answer, the daemon's other sessions served as promptly as ever.
Where this machine cannot make cgroups the test is skipped (the cgroup parsing is unit-tested on both drivers'
paths in tests/unit/daemon/kubelet/test_pod_gpus.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client
from tests.checkpoint_files import write_shard
from tests.helpers import (
    REPO,
    DaemonProcess,
    client_env,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    stop_and_check,
    wait_until,
)

pytest.importorskip("grpc", reason="grpcio is not installed (the kubernetes extra, in the test extra)")
from tests.kubelet_fakes import HOLD_LIMIT, Cgroups, FakeApiServer, Pod, cgroup_root, kubelet, placed

NODE = "node-a"
WEIGHTS = np.arange(4096, dtype=np.float32)

CLIENT = """
import json, os
import numpy as np
from cuctxd import Client
from cuctxd.protos.errors import CuctxError

said = {"pid": os.getpid()}
with Client(ENDPOINT) as client:
    buffer = client.alloc(1 << 20, device=1)
    client.write(buffer, b"x" * 100)
    said["read"] = client.read(buffer, 100) == b"x" * 100
    said["devices"] = [s["devices"] for s in client.status()["sessions"] if s["session"] == client.session_id]
    with client.open_shared("model@1") as opened:
        said["weights"] = np.arange(4096, dtype=np.float32).tobytes() in opened.read()
    for what, call in (("alloc", lambda: client.alloc(1 << 20, device=0)),
                       ("open_shared", lambda: client.open_shared("model@0"))):
        try:
            call()
            said[what] = "allowed"
        except CuctxError as error:
            said[what] = error.name
print(json.dumps(said))
"""

HELLO = """
from cuctxd import Client
from cuctxd.protos.errors import CuctxError
try:
    Client(ENDPOINT).close()
    print("allowed")
except CuctxError as error:
    print(error.name, error.message)
"""


def own_pid_namespace() -> list[str]:
    """``unshare --pid --fork --mount-proc`` where this machine allows it, else nothing (said in the skip)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1): cannot start a client in a PID namespace of its own")
    argv = [unshare, "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("unshare --pid is not permitted here: cannot start a client in a PID namespace of its own")
    return argv


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    root = cgroup_root()
    if root is None:
        pytest.skip("no writable cgroup v2 hierarchy: cannot place client processes in pods' cgroups")
    made = Cgroups(root)
    try:
        yield made
    finally:
        made.remove()


def run_in(cgroup: Path, code: str, endpoint: str, prefix: Sequence[str] = ()) -> str:
    done = subprocess.run(placed(cgroup, [*prefix, sys.executable, "-c", f"ENDPOINT = {endpoint!r}\n{code}"]),
                          capture_output=True, text=True, env=client_env(), cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_pod_is_served_on_its_gpus_and_refused_the_others(cgroups: Cgroups, tmp_path: Path) -> None:
    namespace = own_pid_namespace()
    checkpoint = write_shard(tmp_path / "model.safetensors", {"w": WEIGHTS})
    sockets = short_tempdir()
    daemon: DaemonProcess | None = None
    try:
        pod_a = Pod("team-a", "client-a", {"main": {"nvidia.com/gpu": [], "cuctxd.io/client": ["client-0"]}})
        stranger = Pod("team-b", "gone", {})
        with kubelet(sockets / "kubelet.sock", NODE, [pod_a]) as (resources, apiserver):
            daemon = start_daemon("--gpu-limit", "--pod-resources-socket", str(sockets / "kubelet.sock"),
                                  "--kubernetes-api", apiserver.url, "--node-name", NODE,
                                  "--preload", f"model={checkpoint}@0,1")
            with Client(daemon.endpoint) as operator:  # the daemon's own cgroup: every device, the preload too
                assert wait_until(lambda: operator.status()["ready"], 60), daemon.log()
                uuids = [device.uuid for device in operator.devices()]
            pod_a.containers["main"]["nvidia.com/gpu"] = [uuids[1]]

            said = json.loads(run_in(cgroups.pod(pod_a), CLIENT, daemon.endpoint, namespace).splitlines()[-1])
            assert said["pid"] == 1, "the client runs in a PID namespace of its own"
            assert said["read"] and said["weights"] and said["devices"] == [[1]], said
            assert said["alloc"] == said["open_shared"] == "CUCTXD_ERROR_DEVICE_NOT_ALLOWED", said
            assert f"gpu_limit: pod team-a/client-a (UID {pod_a.uid}) may use device(s) [1]" in daemon.log()
            assert resources.calls == 1
            with Client(daemon.endpoint) as operator:
                assert [s["devices"] for s in operator.status()["sessions"]] == [None], "the operator's own"

            asked = apiserver.requests
            for _ in range(2):  # the second is refused without asking again
                refused = run_in(cgroups.pod(stranger), HELLO, daemon.endpoint)
                assert refused.startswith("CUCTXD_ERROR_DEVICE_NOT_ALLOWED") and stranger.uid in refused, refused
            assert apiserver.requests == asked + 1
            refused = run_in(cgroups.plain("not-a-pod"), HELLO, daemon.endpoint)
            assert refused.startswith("CUCTXD_ERROR_DEVICE_NOT_ALLOWED") and "in no Kubernetes pod" in refused, refused
    finally:
        if daemon is not None:
            stop_and_check(daemon)
        remove_tempdir(sockets)


#: A client that imports first and says hello only once told to (a line on its stdin), so that its start-up
#: is paid before the test starts timing; it reports what its session may use, or why it has none.
ON_CUE = """
import json, sys
from cuctxd import Client
from cuctxd.client.wire.build import Request
from cuctxd.protos import ops
from cuctxd.protos.errors import CuctxError
print("ready", flush=True)
sys.stdin.readline()
said = {}
try:
    with Client(ENDPOINT) as client:
        said["allowed"] = client.allowed_devices
        said["listed"] = client.run(Request(ops.Devices(), lambda result, _: result["allowed_devices"]))
        said["count"] = client.run(Request(ops.DeviceCount(), lambda result, _: result["allowed_devices"]))
        client.free(client.alloc(4096, device=client.allowed_devices[0]))
except CuctxError as error:
    said["error"] = f"{error.name} {error.message}"
print(json.dumps(said))
"""


class OnCue:
    """A client process in ``cgroup`` running :data:`ON_CUE`: started, ready, and told to say hello."""

    def __init__(self, cgroup: Path, endpoint: str) -> None:
        argv = placed(cgroup, [sys.executable, "-c", f"ENDPOINT = {endpoint!r}\n{ON_CUE}"])
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=client_env(), cwd=REPO)
        assert self.process.stdout is not None and self.process.stdin is not None
        ready = self.process.stdout.readline()
        assert ready.strip() == "ready", ready + self.process.communicate(timeout=30)[1]

    def hello(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def said(self) -> dict[str, object]:
        out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, err
        return dict(json.loads(out.splitlines()[-1]))

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=30)


def worst_latency(client: Client, seconds: float) -> float:
    """The slowest of ``client``'s front ops (ping, status) and device ops through the main socket (alloc, free)
    over ``seconds``."""
    worst = 0.0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for call in (client.ping, client.status, lambda: client.free(client.alloc(4096, device=0))):
            started = time.perf_counter()
            call()
            worst = max(worst, time.perf_counter() - started)
    return worst


def pod_lookups(client: Client) -> dict[str, int]:
    return dict(client.status()["pod_lookups"])


@pytest.fixture
def sockets() -> Iterator[Path]:
    made = short_tempdir()
    try:
        yield made
    finally:
        remove_tempdir(made)


def gpu_limited(sockets: Path, apiserver: FakeApiServer, *extra: str) -> DaemonProcess:
    return start_daemon("--gpu-limit", "--pod-resources-socket", str(sockets / "kubelet.sock"),
                        "--kubernetes-api", apiserver.url, "--node-name", NODE, "--no-device-endpoints", *extra)


def test_a_pods_lookup_holds_up_no_other_session(cgroups: Cgroups, sockets: Path) -> None:
    """While the API server holds its answer for a new pod's first hellos (two at once: one lookup), the
    daemon's own session is served on the main socket without waiting for it; then both hellos are answered."""
    pod_a = Pod("team-a", "client-a", {"main": {"nvidia.com/gpu": []}})
    clients: list[OnCue] = []
    with kubelet(sockets / "kubelet.sock", NODE, [pod_a]) as (resources, apiserver):
        daemon = gpu_limited(sockets, apiserver)
        try:
            with Client(daemon.endpoint) as bystander:
                pod_a.containers["main"]["nvidia.com/gpu"] = [bystander.devices()[1].uuid]
                clients = [OnCue(cgroups.pod(pod_a), daemon.endpoint) for _ in range(2)]
                apiserver.hold()
                clients[0].hello()
                assert wait_until(lambda: apiserver.waiting == 1, 30), daemon.log()
                worst = worst_latency(bystander, 1.0)
                still_held = apiserver.waiting == 1
                assert worst < HOLD_LIMIT / 4, f"a bystander's request waited {worst:.3f} s on a pod's lookup"
                assert still_held, "the lookup ended before the bystander's requests did: nothing was measured"
                clients[1].hello()
                assert wait_until(lambda: pod_lookups(bystander)["waiting"] == 2, 30), daemon.log()
                assert apiserver.waiting == 1 and pod_lookups(bystander)["lookups"] == 1
                apiserver.release()
                for client in clients:
                    assert client.said() == {"allowed": [1], "listed": [1], "count": [1]}
                assert apiserver.requests == 1 and resources.calls == 1, "one lookup for the pod's two hellos"
                assert pod_lookups(bystander)["waiting"] == 0
                assert bystander.allowed_devices is None, "the daemon's own cgroup may use every device"
        finally:
            for client in clients:
                client.kill()
            stop_and_check(daemon)


def test_hellos_past_max_pending_hellos_are_refused_by_name(cgroups: Cgroups, sockets: Path) -> None:
    """One lookup at a time and two hellos waiting: a third pod's hello is refused at once, naming the limit,
    the bystander is served meanwhile, and the two waiting are answered once the API server answers."""
    pods = [Pod("team", f"pod-{n}", {"main": {"nvidia.com/gpu": []}}) for n in range(3)]
    clients: list[OnCue] = []
    with kubelet(sockets / "kubelet.sock", NODE, pods) as (_, apiserver):
        daemon = gpu_limited(sockets, apiserver, "--max-pod-lookups", "1", "--max-pending-hellos", "2")
        try:
            with Client(daemon.endpoint) as bystander:
                for pod in pods:
                    pod.containers["main"]["nvidia.com/gpu"] = [bystander.devices()[0].uuid]
                clients = [OnCue(cgroups.pod(pod), daemon.endpoint) for pod in pods]
                apiserver.hold()
                clients[0].hello()
                clients[1].hello()
                assert wait_until(lambda: pod_lookups(bystander)["waiting"] == 2, 30), daemon.log()
                assert pod_lookups(bystander) == {"waiting": 2, "lookups": 2, "max_pod_lookups": 1,
                                                  "max_pending_hellos": 2}
                assert wait_until(lambda: apiserver.waiting >= 1, 30), daemon.log()
                assert apiserver.waiting == 1, "one lookup at a time: the second pod's waits its turn"
                clients[2].hello()
                refused = clients[2].said()
                worst = worst_latency(bystander, 0.5)
                apiserver.release()
                assert str(refused["error"]).startswith("CUCTXD_ERROR_LIMIT_EXCEEDED max_pending_hellos"), refused
                assert worst < HOLD_LIMIT / 4, f"a bystander's request waited {worst:.3f} s on a pod's lookup"
                for client in clients[:2]:
                    assert client.said() == {"allowed": [0], "listed": [0], "count": [0]}
        finally:
            for client in clients:
                client.kill()
            stop_and_check(daemon)
