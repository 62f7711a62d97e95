"""``gpu_limit`` end to end: a real daemon asks a fake kubelet (PodResources v1 over grpcio) and a fake API
server which GPUs a client's pod holds, the client being a real process placed in a pod's cgroup made here, in
a PID namespace of its own (``unshare --pid --fork``: no hostPID, nothing shared with the daemon's), served over
the socket and the fd channel, its preloaded weights included, and refused, by name, on the GPU its pod lacks.
Where this machine cannot make cgroups the test is skipped (the cgroup parsing is unit-tested on both drivers'
paths in tests/unit/daemon/kubelet/test_pod_gpus.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
from tests.kubelet_fakes import Cgroups, Pod, cgroup_root, kubelet, placed

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
