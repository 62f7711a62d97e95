"""Stand-ins for what a Kubernetes node gives ``gpu_limit``, speaking the real APIs: the kubelet's PodResources
v1 (grpcio over a Unix socket, the same .proto), the API server's pod list (HTTP, the same JSON), and pods as
cgroups (made under a writable cgroup hierarchy, named as the kubelet's systemd driver names them)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc

from cuctxd.daemon.kubelet import podresources_v1_pb2 as api
from cuctxd.daemon.kubelet import podresources_v1_pb2_grpc as rpc


@dataclass
class Pod:
    namespace: str
    name: str
    #: Per container: resource name -> device ids.
    containers: dict[str, dict[str, list[str]]]
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))


class FakePodResources(rpc.PodResourcesListerServicer):  # type: ignore[misc]
    """The kubelet's PodResourcesLister ``List`` over ``socket_path``, listing :attr:`pods`."""

    def __init__(self, socket_path: Path, pods: list[Pod]) -> None:
        self.pods = pods
        self.calls = 0
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        rpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{socket_path}")

    def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        return api.ListPodResourcesResponse(pod_resources=[
            api.PodResources(name=pod.name, namespace=pod.namespace, containers=[
                api.ContainerResources(name=name, devices=[api.ContainerDevices(resource_name=resource, device_ids=ids)
                                                           for resource, ids in resources.items()])
                for name, resources in pod.containers.items()])
            for pod in self.pods])


#: Seconds a held answer waits for :meth:`FakeApiServer.release` at most: less than the daemon's own timeout
#: for the API server (``LOOKUP_TIMEOUT``), so that a held lookup still succeeds, only late.
HOLD_LIMIT = 4.0


class FakeApiServer:
    """``GET /api/v1/pods?fieldSelector=spec.nodeName=NODE``: the pods of ``node``, as the API server lists them;
    between :meth:`hold` and :meth:`release`, each request waits (:attr:`waiting` counts them) before its answer."""

    def __init__(self, node: str, pods: list[Pod]) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                selector = urllib.parse.parse_qs(url.query).get("fieldSelector", [""])[0]
                if url.path != "/api/v1/pods" or selector != f"spec.nodeName={node}":
                    self.send_error(400, f"unexpected request {self.path}")
                    return
                fake.requests += 1
                fake.wait_if_held()
                body = json.dumps({"kind": "PodList", "apiVersion": "v1", "items": [
                    {"metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid}} for p in fake.pods]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.pods = pods
        self.requests = 0
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.waiting = 0
        self._released = threading.Event()
        self._released.set()
        self._lock = threading.Lock()

    def hold(self) -> None:
        """From now on, hold each answer until :meth:`release` (or :data:`HOLD_LIMIT`)."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def wait_if_held(self) -> None:
        """A request's handler thread: wait while answers are held."""
        if self._released.is_set():
            return
        with self._lock:
            self.waiting += 1
        self._released.wait(HOLD_LIMIT)
        with self._lock:
            self.waiting -= 1


@contextmanager
def kubelet(socket_path: Path, node: str, pods: list[Pod]) -> Iterator[tuple[FakePodResources, FakeApiServer]]:
    resources, apiserver = FakePodResources(socket_path, pods), FakeApiServer(node, pods)
    resources.server.start()
    apiserver.thread.start()
    try:
        yield resources, apiserver
    finally:
        apiserver.http.shutdown()
        apiserver.http.server_close()
        resources.server.stop(None)


def cgroup_root() -> Path | None:
    """A cgroup v2 hierarchy this process may make cgroups in (pure v2, or hybrid's ``unified``), else None."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            probe = root / f"cuctxd-probe-{os.getpid()}"
            try:
                probe.mkdir()
                probe.rmdir()
            except OSError:
                continue
            return root
    return None


class Cgroups:
    """Cgroups made for one test under ``root``/cuctxd-test-N, removed (leaves first) by :meth:`remove`."""

    def __init__(self, root: Path) -> None:
        self.top = root / f"cuctxd-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.top.mkdir()

    def pod(self, pod: Pod) -> Path:
        """A container's cgroup in ``pod``, named as the systemd cgroup driver names it."""
        slice_ = f"kubepods-besteffort-pod{pod.uid.replace('-', '_')}.slice"
        path = (self.top / "kubepods.slice" / "kubepods-besteffort.slice" / slice_ /
                f"cri-containerd-{uuid.uuid4().hex}.scope")
        path.mkdir(parents=True)
        return path

    def plain(self, name: str) -> Path:
        path = self.top / name
        path.mkdir()
        return path

    def remove(self) -> None:
        for directory in sorted((p for p in self.top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            directory.rmdir()
        self.top.rmdir()


def placed(cgroup: Path, argv: list[str]) -> list[str]:
    """``argv`` run in ``cgroup``: a shell moves itself there, then execs it (children stay in it)."""
    shell = shutil.which("sh") or "/bin/sh"
    return [shell, "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *argv]
