"""deploy/kubernetes/ as a cluster would take it, without a cluster: every manifest validates against
the Kubernetes API schemas of three versions (``kubernetes-validate``, strict: no field the API does not know),
the kustomization lists them all, the DaemonSet's daemon and device plugin arguments are ones they accept, its
probe commands answer a real daemon (and fail without one), the RBAC grants listing pods and nothing more, the
paths agree with each other, with cuctxd.client.ray_nodes and with the image, and the example client passes Pod Security
"baseline" (its rules, checked here) with neither hostPID nor a hostPath."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cuctxd.client.ray_nodes import NODE_SOCKET
from tests.helpers import REPO, DaemonProcess, client_env, cuctxd, short_tempdir

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (it is in the test extra): the "
                                  "manifests cannot be checked against the Kubernetes API schemas")
yaml = pytest.importorskip("yaml")

DEPLOY = REPO / "deploy" / "kubernetes"
#: The resources (kustomization.yaml is kustomize's, not the API's).
MANIFESTS = sorted(path for path in DEPLOY.glob("*.yaml") if path.name != "kustomization.yaml")
#: The oldest Kubernetes the manifests are meant for, one between, and the newest the validator knows.
VERSIONS = ("1.28.0", "1.30.0", kubernetes_validate.latest_version())


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


def container(name: str) -> dict[str, Any]:
    found = [c for c in pod_spec("DaemonSet")["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r} in the DaemonSet"
    return found[0]


def test_the_manifests_are_there_and_the_kustomization_lists_them() -> None:
    assert [path.name for path in MANIFESTS] == ["client-example.yaml", "daemonset.yaml", "namespace.yaml",
                                                 "rbac.yaml"]
    kustomization = documents(DEPLOY / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [path.name for path in MANIFESTS]


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
    daemon = container("cuctxd")
    gid = str(os.getgid())  # the image's group 2000 need not exist here
    args = [arg.replace("$(NODE_NAME)", "node-a").replace("--group=2000", f"--group={gid}")
            for arg in daemon["args"]]
    done = cuctxd(*args, "--print-config")
    assert done.returncode == 0, done.stderr
    assert 'node_name = "node-a"' in done.stdout
    assert f'endpoints = ["ipc://{NODE_SOCKET}"]' in done.stdout
    assert "--group=2000" in daemon["args"]


def test_the_device_plugin_arguments_are_ones_it_accepts_and_hand_out_the_daemons_socket() -> None:
    from cuctxd.daemon.kubelet.device_plugin import PluginConfig, build_parser

    plugin = container("device-plugin")
    assert plugin["command"][0] == "cuctxd-device-plugin"
    args = build_parser().parse_args(plugin["command"][1:])
    handed = PluginConfig(args.socket_dir, args.container_dir, args.socket_name, args.resource)
    assert handed.endpoint == f"ipc://{NODE_SOCKET}" and handed.resource == "cuctxd.io/client"
    relay = args.relay_pod_resources
    daemon_args = container("cuctxd")["args"]
    assert f"--pod-resources-socket={relay}" in daemon_args and "--gpu-limit" in daemon_args
    shared = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    assert {m["name"]: m["mountPath"] for m in container("cuctxd")["volumeMounts"]}["kubelet-relay"] == \
        shared["kubelet-relay"] == os.path.dirname(relay)
    assert "emptyDir" in next(v for v in pod_spec("DaemonSet")["volumes"] if v["name"] == "kubelet-relay")


def test_the_socket_path_is_the_same_everywhere() -> None:
    endpoint = f"ipc://{NODE_SOCKET}"
    daemon, client = pod_spec("DaemonSet"), pod_spec("Deployment")
    assert env_of(container("cuctxd"))["CUCTXD_ENDPOINT"] == endpoint
    socket_dir = os.path.dirname(NODE_SOCKET)
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in daemon["volumes"] if "hostPath" in volume}
    assert host_paths["socket-dir"] == socket_dir
    for name in ("cuctxd", "device-plugin"):
        mounts = {mount["name"]: mount["mountPath"] for mount in container(name)["volumeMounts"]}
        assert mounts["socket-dir"] == socket_dir
    assert daemon["hostPID"] is True and daemon["runtimeClassName"] == "nvidia"
    assert 2000 in client["securityContext"]["supplementalGroups"]
    assert daemon["securityContext"]["runAsUser"] == 2000
    client_container = client["containers"][0]
    assert "CUCTXD_ENDPOINT" not in env_of(client_container), "the device plugin sets it"
    assert client_container["resources"]["limits"]["cuctxd.io/client"] == 1
    assert client_container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_daemon_may_list_pods_and_nothing_more() -> None:
    role = resource("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = resource("ClusterRoleBinding")
    account = resource("ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    spec = pod_spec("DaemonSet")
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    with_token = [c["name"] for c in spec["containers"] + spec["initContainers"]
                  if any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
                         for m in c.get("volumeMounts", []))]
    assert with_token == ["cuctxd"], "only the daemon's container holds the API token"


def test_every_container_has_resources_and_the_long_running_ones_probes() -> None:
    spec = pod_spec("DaemonSet")
    for each in spec["containers"] + spec["initContainers"] + pod_spec("Deployment")["containers"]:
        assert each["resources"]["requests"] and each["resources"]["limits"]["memory"], each["name"]
    assert "--ready" in container("cuctxd")["readinessProbe"]["exec"]["command"]
    for each in spec["containers"]:
        assert "livenessProbe" in each, each["name"]


#: Pod Security "baseline" (kubernetes.io/docs/concepts/security/pod-security-standards): the capabilities a
#: container may add, the sysctls a pod may set, the SELinux types it may name.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
BASELINE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                    "net.ipv4.tcp_keepalive_probes"}
BASELINE_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def baseline_violations(spec: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    """What in a pod spec breaks Pod Security "baseline" (empty: it passes)."""
    found = [f"{key}: true" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    found += [f"volume {v['name']}: hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    pod_context = spec.get("securityContext", {})
    found += [f"sysctl {s['name']}" for s in pod_context.get("sysctls", []) if s["name"] not in BASELINE_SYSCTLS]
    contexts = [("pod", pod_context)]
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for each in spec.get(kind, []):
            context = each.get("securityContext", {})
            contexts.append((each["name"], context))
            if context.get("privileged"):
                found.append(f"{each['name']}: privileged")
            added = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
            found += [f"{each['name']}: adds {cap}" for cap in sorted(added)]
            found += [f"{each['name']}: hostPort" for port in each.get("ports", []) if port.get("hostPort")]
            if context.get("procMount", "Default") != "Default":
                found.append(f"{each['name']}: procMount")
    for name, context in contexts:
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{name}: hostProcess")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{name}: seccomp Unconfined")
        if context.get("appArmorProfile", {}).get("type") == "Unconfined":
            found.append(f"{name}: AppArmor Unconfined")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in BASELINE_SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{name}: seLinuxOptions")
    found += [f"annotation {k}" for k, v in annotations.items()
              if k.startswith("container.apparmor.security.beta.kubernetes.io/") and v == "unconfined"]
    return found


def test_the_example_client_passes_pod_security_baseline_in_a_baseline_namespace() -> None:
    deployment = resource("Deployment")
    template = deployment["spec"]["template"]
    assert baseline_violations(template["spec"], template["metadata"].get("annotations", {})) == []
    namespaces = {doc["metadata"]["name"]: doc["metadata"]["labels"]
                  for doc in documents(DEPLOY / "namespace.yaml") if doc["kind"] == "Namespace"}
    assert namespaces[deployment["metadata"]["namespace"]]["pod-security.kubernetes.io/enforce"] == "baseline"
    daemon_set = resource("DaemonSet")
    assert baseline_violations(pod_spec("DaemonSet"), {}), "the rules must be able to fail: the DaemonSet breaks them"
    assert namespaces[daemon_set["metadata"]["namespace"]]["pod-security.kubernetes.io/enforce"] == "privileged"


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
