"""deploy/kubernetes/ as a cluster would take it, without a cluster: every manifest validates against
the Kubernetes API schemas (``kubernetes-validate``, strict: no field the API does not know), the
DaemonSet's daemon arguments are ones ``cuctxd`` accepts, its probe command answers a real daemon
(and fails without one), and the paths agree with each other, with cuctxd.ray and with the image."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cuctxd.ray import NODE_SOCKET
from tests.helpers import REPO, DaemonProcess, client_env, cuctxd, short_tempdir

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (it is in the test extra): the "
                                  "manifests cannot be checked against the Kubernetes API schemas")
yaml = pytest.importorskip("yaml")

DEPLOY = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
#: The oldest Kubernetes the manifests are meant for, and the newest the validator knows.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def resource(kind: str) -> dict[str, Any]:
    found = [doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes/, found {len(found)}"
    return found[0]


def pod_spec(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = resource(kind)["spec"]["template"]["spec"]
    return spec


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def test_the_manifests_are_there() -> None:
    assert [path.name for path in MANIFESTS] == ["client-example.yaml", "daemonset.yaml", "namespace.yaml"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_manifest_validates_strictly(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{path.name}, {doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): "
                                 f"{error.message} at {list(error.path)}") from None


def test_the_daemon_arguments_are_ones_cuctxd_accepts() -> None:
    container = pod_spec("DaemonSet")["containers"][0]
    gid = str(os.getgid())  # the image's group 2000 need not exist here
    args = [arg.replace("$(NODE_NAME)", "node-a").replace("--group=2000", f"--group={gid}")
            for arg in container["args"]]
    done = cuctxd(*args, "--print-config")
    assert done.returncode == 0, done.stderr
    assert 'node_name = "node-a"' in done.stdout
    assert f'endpoints = ["ipc://{NODE_SOCKET}"]' in done.stdout
    assert "--group=2000" in container["args"]


def test_the_socket_path_is_the_same_everywhere() -> None:
    endpoint = f"ipc://{NODE_SOCKET}"
    daemon, client = pod_spec("DaemonSet"), pod_spec("Deployment")
    assert env_of(daemon["containers"][0])["CUCTXD_ENDPOINT"] == endpoint
    assert env_of(client["containers"][0])["CUCTXD_ENDPOINT"] == endpoint
    socket_dir = os.path.dirname(NODE_SOCKET)
    for spec in (daemon, client):
        assert spec["hostPID"] is True and spec["runtimeClassName"] == "nvidia"
        host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in spec["volumes"] if "hostPath" in volume}
        mounts = {mount["name"]: mount["mountPath"] for mount in spec["containers"][0]["volumeMounts"]}
        assert [mounts[name] for name in host_paths] == [socket_dir] and list(host_paths.values()) == [socket_dir]
    assert 2000 in client["securityContext"]["supplementalGroups"]
    assert daemon["securityContext"]["runAsUser"] == 2000


def test_the_probe_answers_a_daemon_and_fails_without_one(daemon: DaemonProcess) -> None:
    probe = pod_spec("DaemonSet")["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[0] == "cuctx"
    command = [sys.executable, "-m", "cuctxd.client", *probe[1:]]  # what the cuctx console script runs
    ok = subprocess.run(command, env=dict(client_env(), CUCTXD_ENDPOINT=daemon.endpoint), capture_output=True,
                        text=True, timeout=30, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    empty = short_tempdir()
    try:
        down = subprocess.run(command, env=dict(client_env(), CUCTXD_ENDPOINT=f"ipc://{empty}/none.sock"),
                              capture_output=True, text=True, timeout=30, cwd=REPO)
    finally:
        empty.rmdir()
    assert down.returncode != 0 and "CUCTXD_NO_DAEMON" in down.stderr, down.stderr


def test_the_image_copies_every_shipped_part() -> None:
    recipe = (DEPLOY / "Containerfile").read_text()
    copied = {word.rstrip("/") for line in re.findall(r"^COPY (?!--from)(.*) \S+$", recipe, re.MULTILINE)
              for word in line.split()}
    shipped = {"protos", "client", "daemon", "pyproject.toml", "README.md", "LICENSE"}
    root_modules = {path.name for path in REPO.glob("*.py")}
    assert copied == shipped | root_modules, f"the Containerfile copies {sorted(copied)}"
    assert re.search(r"^FROM python:3\.\d+-slim", recipe, re.MULTILINE), "README names the base image"
