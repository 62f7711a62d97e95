"""``gpu_limit``: which of the daemon's devices a client process may use, namely the GPUs the kubelet gave its pod.

The chain, for the pid the kernel reported for the peer's connection (``SO_PEERCRED``, in the
daemon's PID namespace whatever namespace the client runs in):

1. ``/proc/<pid>/cgroup`` names the pod's UID (``.../kubepods-burstable-pod<uid>.slice/...`` with the
   systemd cgroup driver, ``/kubepods/burstable/pod<uid>/...`` with cgroupfs): :func:`pod_uid_of`.
2. The API server's pods of this node say the UID's namespace and name (:class:`PodDirectory`; the
   kubelet's PodResources API does not carry UIDs). RBAC: ``list`` on ``pods``, nothing more.
3. The kubelet's PodResources API (``List``, v1) says which devices of ``gpu_resource`` each container
   of that pod holds (:class:`PodResources`); the NVIDIA device plugin's ids are GPU UUIDs.
4. The daemon's devices whose UUID is one of them are the session's (:meth:`GpuLimit.look_up`).

The pid is the one the kernel recorded when the client connected; were that process gone and its pid
reused by a process of another pod before ``hello``, the lookup would find the other pod (the peer's
pidfd, which would close that gap, is not something libzmq reports).

A process in the daemon's own cgroup (its probes, its preload, ``kubectl exec`` into its container)
may use every device. Anything the chain cannot resolve is refused with
``CUCTXD_ERROR_DEVICE_NOT_ALLOWED`` naming the step. :meth:`GpuLimit.devices_for` runs on the front
thread, at ``hello``, and answers from what it knows (step 1 reads only ``/proc``); steps 2 and 3 ask
services outside the daemon (each bounded by ``timeout``), so they are a :class:`PodLookup` the front
runs on its lookup pool (:mod:`cuctxd.daemon.front.lookups`), never on its own thread. A pod's answer
is cached (its devices do not change while it lives), so only a pod's first session waits for the two
lookups, and a pod that could not be resolved is refused again without them for :data:`REFUSAL_TTL`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from cuctxd.daemon.kubelet import podresources_v1_pb2 as api
from cuctxd.daemon.kubelet import podresources_v1_pb2_grpc as rpc
from cuctxd.protos.errors import DeviceNotAllowed

log = logging.getLogger(__name__)

#: Where a pod finds its service account.
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
#: Seconds each lookup (API server, kubelet) may take.
LOOKUP_TIMEOUT = 5.0
#: Pods whose devices are remembered (the oldest forgotten first; a forgotten pod is looked up again).
CACHED_PODS = 4096
#: Seconds a pod that could not be resolved is refused again without a lookup, so that a pod repeating its
#: hello cannot keep the lookup pool asking the API server or the kubelet.
REFUSAL_TTL = 5.0

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def pod_uid_of(cgroup: str) -> str | None:
    """The pod UID in the text of a ``/proc/<pid>/cgroup``, or None when the process is in no pod."""
    found = _POD_UID.search(cgroup)
    return found.group(1).replace("_", "-") if found else None


def read_cgroup(pid: int) -> str:
    """``/proc/<pid>/cgroup``; OSError when the process is gone."""
    with open(f"/proc/{pid}/cgroup") as file:
        return file.read()


class PodDirectory:
    """Pod UIDs of this node to ``(namespace, name)``, from the API server (a lookup pool thread)."""

    def __init__(self, api_url: str, node_name: str, *, timeout: float = LOOKUP_TIMEOUT,
                 service_account: str = SERVICE_ACCOUNT) -> None:
        """``api_url``: empty for the in-cluster address (``KUBERNETES_SERVICE_HOST``, its CA and token)."""
        if not api_url:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
            api_url = f"https://{host}:{port}" if host else ""
        self.api_url = api_url.rstrip("/")
        self.node_name = node_name
        self.timeout = timeout
        self.token_file = os.path.join(service_account, "token")
        ca_file = os.path.join(service_account, "ca.crt")
        self._tls = ssl.create_default_context(cafile=ca_file if os.path.exists(ca_file) else None)

    def name_of(self, uid: str) -> tuple[str, str] | None:
        """The pod's namespace and name; None when no pod of this node has that UID. Raises OSError (and
        ValueError for an answer that is not the API's) when the API server cannot say."""
        if not self.api_url:
            raise OSError("no Kubernetes API server: KUBERNETES_SERVICE_HOST is unset and kubernetes_api empty")
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={self.node_name}"})
        request = urllib.request.Request(f"{self.api_url}/api/v1/pods?{query}", headers={"Accept": "application/json"})
        if os.path.exists(self.token_file):  # re-read each time: the kubelet rotates it
            with open(self.token_file) as file:
                request.add_header("Authorization", f"Bearer {file.read().strip()}")
        context = self._tls if self.api_url.startswith("https:") else None
        with urllib.request.urlopen(request, timeout=self.timeout, context=context) as answer:
            pods = json.load(answer)
        for pod in pods.get("items", []):
            meta = pod.get("metadata", {})
            if meta.get("uid") == uid:
                return str(meta.get("namespace", "")), str(meta.get("name", ""))
        return None


class PodResources:
    """The kubelet's PodResources ``List``, over its Unix socket (a lookup pool thread)."""

    def __init__(self, socket_path: str, *, timeout: float = LOOKUP_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def devices_of(self, namespace: str, name: str, resource: str) -> list[str] | None:
        """The ids of ``resource`` every container of the pod holds; None when the kubelet lists no such pod.
        Raises grpc.RpcError when the kubelet cannot be asked."""
        with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
            listed = rpc.PodResourcesListerStub(channel).List(api.ListPodResourcesRequest(), timeout=self.timeout)
        for pod in listed.pod_resources:
            if pod.namespace == namespace and pod.name == name:
                return [id_ for container in pod.containers for devices in container.devices
                        if devices.resource_name == resource for id_ in devices.device_ids]
        return None


@dataclass(frozen=True)
class PodLookup:
    """What :meth:`GpuLimit.devices_for` cannot answer at once: pod ``key``'s devices, asked of the API server
    and the kubelet when called (on a lookup pool thread; the answer is cached before it returns). Raises
    DeviceNotAllowed. Hellos of one pod share one lookup: its ``key`` is the pod's UID."""

    limit: GpuLimit
    key: str
    pid: int

    def __call__(self) -> frozenset[int]:
        return self.limit.look_up(self.pid, self.key)


class GpuLimit:
    """The devices each client process may use: :meth:`devices_for` on the front thread at ``hello``,
    :meth:`look_up` on a lookup pool thread; its caches are shared by both, under one lock."""

    def __init__(self, device_uuids: Sequence[str], pods: PodDirectory, resources: PodResources,
                 resource: str = "nvidia.com/gpu", own_cgroup: str | None = None) -> None:
        """``device_uuids``: the UUID of each device the daemon serves, by index. ``own_cgroup``: the daemon's
        ``/proc/self/cgroup`` (read here when None)."""
        self.device_uuids = list(device_uuids)
        self.pods = pods
        self.resources = resources
        self.resource = resource
        self.own_cgroup = read_cgroup(os.getpid()) if own_cgroup is None else own_cgroup
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, frozenset[int]] = OrderedDict()
        #: Pods refused lately: when the refusal stops being repeated, and its message.
        self._refused: dict[str, tuple[float, str]] = {}

    def devices_for(self, pid: int | None) -> frozenset[int] | PodLookup | None:
        """The indices of the devices process ``pid`` may use, None for all of them (the daemon's own cgroup),
        or, for a pod not known yet, the :class:`PodLookup` that asks. Raises DeviceNotAllowed when it cannot
        be told: no pid, no pod, or a pod refused less than :data:`REFUSAL_TTL` ago. Front thread; reads
        only ``/proc`` and the caches."""
        if pid is None:
            raise DeviceNotAllowed("gpu_limit: the connection does not say which process it is (only ipc:// "
                                   "endpoints do), so the daemon cannot tell its pod's GPUs")
        try:
            cgroup = read_cgroup(pid)
        except OSError as error:
            raise DeviceNotAllowed(f"gpu_limit: cannot read process {pid}'s cgroup: {error}") from None
        if cgroup == self.own_cgroup:
            return None
        uid = pod_uid_of(cgroup)
        if uid is None:
            raise DeviceNotAllowed(f"gpu_limit: process {pid} is in no Kubernetes pod (its cgroup: "
                                   f"{cgroup.strip().splitlines()[-1] if cgroup.strip() else 'none'})")
        with self._lock:
            cached = self._cache.get(uid)
            if cached is not None:
                self._cache.move_to_end(uid)
                return cached
            refused = self._refused.get(uid)
        if refused is not None and refused[0] > time.monotonic():
            raise DeviceNotAllowed(refused[1])
        return PodLookup(self, uid, pid)

    def look_up(self, pid: int, uid: str) -> frozenset[int]:
        """Pod ``uid``'s devices, asked of the API server and the kubelet (process ``pid`` is in it), and
        remembered; raises DeviceNotAllowed, remembered for :data:`REFUSAL_TTL`. A lookup pool thread."""
        try:
            allowed = self._look_up(pid, uid)
        except DeviceNotAllowed as error:
            with self._lock:
                self._refused[uid] = (time.monotonic() + REFUSAL_TTL, error.message)
                if len(self._refused) > CACHED_PODS:
                    self._refused.pop(next(iter(self._refused)))
            raise
        with self._lock:
            self._refused.pop(uid, None)
            self._cache[uid] = allowed
            if len(self._cache) > CACHED_PODS:
                self._cache.popitem(last=False)
        return allowed

    def _look_up(self, pid: int, uid: str) -> frozenset[int]:
        try:
            named = self.pods.name_of(uid)
        except (OSError, ValueError) as error:
            raise DeviceNotAllowed(f"gpu_limit: the API server did not say which pod has UID {uid}: {error}") from None
        if named is None:
            raise DeviceNotAllowed(f"gpu_limit: no pod of this node has UID {uid} (process {pid})")
        namespace, name = named
        try:
            ids = self.resources.devices_of(namespace, name, self.resource)
        except grpc.RpcError as error:
            raise DeviceNotAllowed(f"gpu_limit: the kubelet's PodResources API did not answer for pod "
                                   f"{namespace}/{name}: {error.code().name}") from None  # type: ignore[attr-defined]
        if ids is None:
            raise DeviceNotAllowed(f"gpu_limit: the kubelet lists no pod {namespace}/{name}")
        allowed = frozenset(index for index, uuid in enumerate(self.device_uuids) if uuid in ids)
        log.info("gpu_limit: pod %s/%s (UID %s) may use device(s) %s (%s %s)", namespace, name, uid,
                 sorted(allowed) or "none", self.resource, ", ".join(ids) or "none")
        return allowed
