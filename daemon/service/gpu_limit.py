"""``gpu_limit`` assembled: the daemon's devices, its node and the kubelet's sockets, as the front's
``device_limit`` (:class:`cuctxd.daemon.kubelet.pod_gpus.GpuLimit`). The kubelet package needs the
``kubernetes`` extra, so it is imported only when the setting is on."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from cuctxd.daemon.registry.daemon_state import DeviceLimit
from cuctxd.daemon.service.config import ConfigError, DaemonConfig
from cuctxd.protos.records import DeviceInfo

log = logging.getLogger(__name__)


def gpu_limit(config: DaemonConfig, devices: Sequence[DeviceInfo]) -> DeviceLimit:
    """The devices each peer pid may use (called on the front thread; what needs the API server and the kubelet
    is a lookup for the front's lookup pool); ConfigError without grpcio."""
    try:
        pod_gpus = importlib.import_module("cuctxd.daemon.kubelet.pod_gpus")
    except ImportError as error:
        raise ConfigError("gpu_limit", f"needs grpcio and protobuf (pip install 'cuctxd[kubernetes]'): {error}") \
            from None
    pods = pod_gpus.PodDirectory(config.kubernetes_api or "", config.node_name)
    limit = pod_gpus.GpuLimit([device.uuid for device in devices], pods,
                              pod_gpus.PodResources(config.pod_resources_socket), config.gpu_resource)
    log.info("gpu_limit on: each session may use only its pod's %s (node %s, PodResources at %s, API server %s)",
             config.gpu_resource, config.node_name, config.pod_resources_socket, pods.api_url or "none")
    devices_for: DeviceLimit = limit.devices_for
    return devices_for
