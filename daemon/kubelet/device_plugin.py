"""The cuctxd device plugin: how a client pod gets the node daemon's socket without hostPath or hostPID.

Shared-GPU plugins hand their clients a pipe the same way. This process runs as its own container in
the DaemonSet, beside the daemon, and speaks the kubelet's device plugin API v1beta1
(``deviceplugin_v1beta1.proto``): it registers a resource (``cuctxd.io/client``) of ``slots``
interchangeable devices, and for each container that requests some, ``Allocate`` answers with a
read-only bind mount of the node's socket directory and ``CUCTXD_ENDPOINT`` naming the socket in it.
The kubelet makes the mount; the pod spec names no host path, so its namespace may stay at Pod
Security "baseline". The devices are healthy while the daemon's socket exists and unhealthy while it
does not (a daemon restart), so the scheduler places no new client on a node whose daemon is gone.

The kubelet removes every plugin socket when it restarts; the plugin then serves a new one and
registers again (:meth:`DevicePlugin.run` polls for it). With ``--relay-pod-resources`` it also relays
the kubelet's PodResources socket to the daemon (:mod:`.relay`). Threads: the main thread runs
:meth:`DevicePlugin.run`; gRPC's own threads answer the kubelet's calls (``ListAndWatch`` streams
wait on :attr:`DevicePlugin.changed`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from cuctxd.daemon.kubelet import POD_RESOURCES_SOCKET
from cuctxd.daemon.kubelet import deviceplugin_v1beta1_pb2 as api
from cuctxd.daemon.kubelet import deviceplugin_v1beta1_pb2_grpc as rpc
from cuctxd.daemon.kubelet.relay import Relay

log = logging.getLogger(__name__)

#: The API version the plugin speaks, and where the kubelet looks for plugins (k8s.io/kubelet's constants).
API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
#: The resource client pods request, and how many pods on one node may hold it at once.
DEFAULT_RESOURCE = "cuctxd.io/client"
DEFAULT_SLOTS = 110  # the kubelet's default maxPods: every pod of a node may be a client
#: Seconds between two looks at the plugin's socket (kubelet restarts) and the daemon's (health).
POLL_INTERVAL = 1.0


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin advertises and hands out. ``socket_dir``: the daemon's socket directory on the node;
    ``container_dir``: where client containers see it; ``socket_name``: the daemon's ipc:// socket in it."""

    socket_dir: str = "/run/cuctxd"
    container_dir: str = "/run/cuctxd"
    socket_name: str = "cuctxd.sock"
    resource: str = DEFAULT_RESOURCE
    slots: int = DEFAULT_SLOTS
    kubelet_dir: str = DEVICE_PLUGIN_DIR
    plugin_socket: str = "cuctxd-client.sock"

    @property
    def endpoint(self) -> str:
        """The ``CUCTXD_ENDPOINT`` client containers get."""
        return f"ipc://{os.path.join(self.container_dir, self.socket_name)}"

    def device_ids(self) -> list[str]:
        return [f"client-{n}" for n in range(self.slots)]


class ClientSlots(rpc.DevicePluginServicer):
    """The DevicePlugin service (gRPC's threads): ``slots`` devices, each one more client pod on the node."""

    def __init__(self, config: PluginConfig, plugin: DevicePlugin) -> None:
        self.config = config
        self.plugin = plugin

    def GetDevicePluginOptions(self, request: api.Empty, context: Any) -> api.DevicePluginOptions:
        """Neither PreStartContainer nor GetPreferredAllocation: any slot serves as well as another."""
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def ListAndWatch(self, request: api.Empty, context: Any) -> Iterator[api.ListAndWatchResponse]:
        """The devices now, then again each time their health changes, until the kubelet or the plugin ends."""
        health = None
        while context.is_active() and not self.plugin.stopping.is_set():
            now = self.plugin.health()
            if now != health:
                health = now
                yield api.ListAndWatchResponse(devices=[api.Device(ID=id_, health=now)
                                                        for id_ in self.config.device_ids()])
            with self.plugin.changed:
                self.plugin.changed.wait(POLL_INTERVAL)

    def Allocate(self, request: api.AllocateRequest, context: Any) -> api.AllocateResponse:
        """Each container: the socket directory, mounted read-only (a client may connect to the sockets in
        it, not remove them), and ``CUCTXD_ENDPOINT``."""
        config = self.config
        answers = []
        for wanted in request.container_requests:
            log.info("allocating %s to a container (%s)", config.resource, ", ".join(wanted.devices_ids))
            answers.append(api.ContainerAllocateResponse(
                envs={"CUCTXD_ENDPOINT": config.endpoint},
                mounts=[api.Mount(container_path=config.container_dir, host_path=config.socket_dir, read_only=True)]))
        return api.AllocateResponse(container_responses=answers)


class DevicePlugin:
    """Serves :class:`ClientSlots` on a socket in the kubelet's plugin directory and registers it there."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.stopping = threading.Event()
        #: Notified when the plugin stops, so that ``ListAndWatch`` streams end at once.
        self.changed = threading.Condition()
        self._server: grpc.Server | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.config.kubelet_dir, self.config.plugin_socket)

    def health(self) -> str:
        """Healthy while the daemon's socket exists (any thread)."""
        daemon_socket = os.path.join(self.config.socket_dir, self.config.socket_name)
        return HEALTHY if os.path.exists(daemon_socket) else UNHEALTHY

    def run(self) -> None:
        """Serve and register; again whenever the kubelet removed the socket (its restart); until :meth:`stop`.

        Raises what registering raised the first time (a kubelet that refuses the plugin, or none there);
        later failures are logged and tried again on the next poll.
        """
        try:
            self._serve_and_register()
            while not self.stopping.wait(POLL_INTERVAL):
                if os.path.exists(self.socket_path):
                    continue
                log.info("%s is gone (the kubelet restarted): serving and registering again", self.socket_path)
                try:
                    self._serve_and_register()
                except (grpc.RpcError, OSError) as error:
                    log.warning("registering with the kubelet failed (trying again): %s", error)
        finally:
            self._stop_server()

    def stop(self) -> None:
        """End :meth:`run` (any thread, signal handlers included)."""
        self.stopping.set()

    def _serve_and_register(self) -> None:
        self._stop_server()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="cuctxd-device-plugin"))
        rpc.add_DevicePluginServicer_to_server(ClientSlots(self.config, self), server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server
        kubelet = os.path.join(self.config.kubelet_dir, KUBELET_SOCKET)
        with grpc.insecure_channel(f"unix:{kubelet}") as channel:
            rpc.RegistrationStub(channel).Register(api.RegisterRequest(
                version=API_VERSION, endpoint=self.config.plugin_socket, resource_name=self.config.resource,
                options=api.DevicePluginOptions()), timeout=10)
        log.info("registered %s (%d slots, endpoint %s, socket directory %s) with the kubelet at %s",
                 self.config.resource, self.config.slots, self.config.endpoint, self.config.socket_dir, kubelet)

    def _stop_server(self) -> None:
        with self.changed:
            self.changed.notify_all()
        if self._server is not None:
            self._server.stop(grace=1).wait()
            self._server = None


def build_parser() -> argparse.ArgumentParser:
    """``cuctxd-device-plugin``'s command line."""
    defaults = PluginConfig()
    parser = argparse.ArgumentParser(prog="cuctxd-device-plugin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket-dir", default=defaults.socket_dir,
                        help="the daemon's socket directory on the node (default %(default)s)")
    parser.add_argument("--container-dir", default=defaults.container_dir,
                        help="where client containers see it (default %(default)s)")
    parser.add_argument("--socket-name", default=defaults.socket_name,
                        help="the daemon's ipc:// socket in it (default %(default)s)")
    parser.add_argument("--resource", default=defaults.resource, help="the resource name (default %(default)s)")
    parser.add_argument("--slots", type=int, default=defaults.slots,
                        help="client pods one node may hold at once (default %(default)s)")
    parser.add_argument("--kubelet-dir", default=defaults.kubelet_dir,
                        help="the kubelet's device plugin directory (default %(default)s)")
    parser.add_argument("--relay-pod-resources", metavar="PATH",
                        help="also relay connections on PATH to the kubelet's PodResources socket, for a daemon "
                             "that does not run as root (gpu_limit; PATH in a directory only the two share)")
    parser.add_argument("--pod-resources-socket", default=POD_RESOURCES_SOCKET,
                        help="the kubelet's PodResources socket (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``cuctxd-device-plugin``: the plugin until SIGTERM or SIGINT."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plugin = DevicePlugin(PluginConfig(args.socket_dir, args.container_dir, args.socket_name, args.resource,
                                       args.slots, args.kubelet_dir))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: plugin.stop())
    relay = None if args.relay_pod_resources is None else Relay(args.relay_pod_resources, args.pod_resources_socket)
    if relay is not None:
        relay.start()
    try:
        plugin.run()
    except grpc.RpcError as error:
        kubelet = os.path.join(args.kubelet_dir, KUBELET_SOCKET)
        log.error("cannot register with the kubelet at %s: %s", kubelet, error.details())  # type: ignore[attr-defined]
        sys.exit(1)
    finally:
        if relay is not None:
            relay.stop()


if __name__ == "__main__":
    main()
