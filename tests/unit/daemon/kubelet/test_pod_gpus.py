"""gpu_limit's parts that need no kubelet: the pod UID in a process's cgroup as each cgroup driver writes it
(the stand-in for machines where tests/integration/test_gpu_limit.py cannot make cgroups), and the refusals
that come before any lookup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (the kubernetes extra, in the test extra)")
from cuctxd.daemon.kubelet.pod_gpus import GpuLimit, PodDirectory, PodResources, pod_uid_of, read_cgroup
from cuctxd.protos.errors import DeviceNotAllowed

UID = "0f3c9b2e-5d41-4c6a-9e77-1a2b3c4d5e6f"


@pytest.mark.parametrize("cgroup", [
    # cgroup v2, systemd driver (the kubelet's default), seen from the host's cgroup namespace
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
    "cri-containerd-8f1e2d.scope\n",
    # the same seen from a container's own cgroup namespace (the daemon's, in its pod)
    f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-8f1e2d.scope\n",
    # cgroup v1, cgroupfs driver
    f"12:pids:/kubepods/burstable/pod{UID}/8f1e2d\n11:memory:/kubepods/burstable/pod{UID}/8f1e2d\n",
], ids=["systemd", "cgroupns", "cgroupfs-v1"])
def test_the_pod_uid_is_read_from_each_drivers_cgroup_path(cgroup: str) -> None:
    assert pod_uid_of(cgroup) == UID


@pytest.mark.parametrize("cgroup", ["0::/\n", "0::/system.slice/containerd.service\n", "0::/user.slice/podman.scope\n"])
def test_a_process_outside_any_pod_has_no_pod_uid(cgroup: str) -> None:
    assert pod_uid_of(cgroup) is None


def limit(own_cgroup: str) -> GpuLimit:
    return GpuLimit(["GPU-a", "GPU-b"], PodDirectory("http://127.0.0.1:1", "node-a"), PodResources("/nonexistent"),
                    own_cgroup=own_cgroup)


def test_the_daemons_own_cgroup_may_use_every_device() -> None:
    assert limit(read_cgroup(os.getpid())).devices_for(os.getpid()) is None


def test_what_cannot_be_told_is_refused_by_name() -> None:
    other = limit("0::/somewhere/else\n")
    with pytest.raises(DeviceNotAllowed, match="only ipc:// endpoints"):
        other.devices_for(None)
    if pod_uid_of(read_cgroup(os.getpid())) is None:
        with pytest.raises(DeviceNotAllowed, match="in no Kubernetes pod"):
            other.devices_for(os.getpid())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with pytest.raises(DeviceNotAllowed, match="cannot read process"):
        other.devices_for(int(gone))
