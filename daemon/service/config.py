"""The daemon's effective configuration: the union of every part's settings, as :class:`DaemonConfig`.

Each setting is declared once, as a field of the limits object of the part of the daemon that reads it
(:class:`DeviceLimits`, :class:`QueueLimits`, :class:`AdmissionLimits`, ...: :mod:`cuctxd.daemon.settings`
lists them), or, when only the service layer reads it, as a field of :class:`DaemonConfig` itself, which
inherits every part's class. :class:`DaemonConfig` is built once at start (defaults, then the ``--config``
TOML file, then command-line flags: see :mod:`cuctxd.daemon.service.config_file`) and only read
afterwards; the assembly (:mod:`cuctxd.daemon.service.server`) hands each part its own object
(:func:`~cuctxd.daemon.settings.part_of`). The file's keys (:data:`SETTINGS`), the command line's flags
(:mod:`cuctxd.daemon.service.cli`) and PROTOCOL.md's limits table are made from the declarations.
:func:`check_config` adds the checks that span keys.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.front.lookups import LookupLimits
from cuctxd.daemon.kubelet import POD_RESOURCES_SOCKET
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.daemon_state import AdmissionLimits
from cuctxd.daemon.registry.fd_budget import FdLimits
from cuctxd.daemon.registry.parking import ParkingLimits
from cuctxd.daemon.registry.shares import ShareLimits
from cuctxd.daemon.registry.tickets import TicketLimits
from cuctxd.daemon.service.preload import Preload, preload_entry, preload_list, preload_texts
from cuctxd.daemon.settings import (
    LOG_LEVELS,
    MAX_SIM_DEVICES,
    NO_DEFAULT,
    Setting,
    check_endpoint,
    choice,
    count,
    declared,
    endpoint_list,
    existing_path,
    fault_injection,
    group_name,
    ordinals,
    ordinals_text,
    seconds,
    setting,
    size,
    string,
    switch,
)
from cuctxd.daemon.side_channel.server import FdChannelLimits
from cuctxd.protos.endpoints import default_endpoint
from cuctxd.protos.shm_lane import polls_busily


def _busy_poll_for_host() -> int:
    """Microseconds a device worker polls without sleeping after a request: 300 on hosts with 8 CPUs or
    more, 0 on smaller ones, where a polling thread takes the CPU a client needs (CUDA's
    ``CU_CTX_SCHED_AUTO`` spins or yields by the same reasoning)."""
    return 300 if polls_busily() else 0


DEFAULT_BUSY_POLL_US = _busy_poll_for_host()

#: Seconds a SIGTERM/SIGINT drain may take before the daemon gives up on in-flight work.
DEFAULT_DRAIN_TIMEOUT = 10.0
#: Seconds a new connection may take to finish its ZeroMQ (and CURVE) handshake before it is dropped.
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: Where the metrics endpoint listens unless told otherwise: this host only.
DEFAULT_METRICS_HOST = "127.0.0.1"


class ConfigError(ValueError):
    """A configuration value is wrong; ``key`` names it as the TOML file spells it."""

    def __init__(self, key: str, message: str, source: str | None = None, *, flag: str | None = None) -> None:
        """``flag``: the value came from the command line, as this flag: the message names it instead of the key."""
        self.key = key
        self.source = source
        where = f" (in {source})" if source else ""
        super().__init__(f"{flag}: {message}" if flag else f"configuration key '{key}'{where}: {message}")


@dataclass(frozen=True)
class DaemonConfig(AdmissionLimits, DeviceLimits, QueueLimits, ShareLimits, TicketLimits, FdLimits, FdChannelLimits,
                   ParkingLimits, LookupLimits):
    """Everything the daemon needs to start; built by the CLI, used read-only afterwards.

    Every part's settings (the classes it inherits), then the service's own, below: ``devices``: the driver
    ordinals to serve, in the order clients see them as devices 0..n-1 (None: every device). ``0`` for a
    size, count or port means "none"/"off". The security and limit settings are checked here and enforced
    where the module docstring of :mod:`cuctxd.daemon.service.server` says. A setting that only the service
    reads is declared here, at the end; one a part reads, on that part's class (:mod:`cuctxd.daemon.settings`).
    """

    endpoints: tuple[str, ...] = setting(
        NO_DEFAULT, endpoint_list, "where to listen: ipc://PATH or tcp://HOST:PORT (PORT * takes any free port); "
        "repeatable", "URL", from_text=check_endpoint, render=list, shown=default_endpoint, flag_name="--endpoint",
        repeat=True, user=True)
    backend: str = choice("auto", "driver backend; auto uses cuda when a driver and a device are present",
                          "auto", "cuda", "sim", user=True)
    sim_devices: int = count(2, "devices of the sim backend", low=1, high=MAX_SIM_DEVICES)
    sim_memory: int = size(1 << 30, "memory per sim device", minimum=1)
    devices: tuple[int, ...] | None = setting(
        None, ordinals, "serve only these driver ordinals, e.g. 2,0; clients see them as devices 0..n-1",
        "ORDINALS", from_text=ordinals_text, render=list, shown="all", user=True)
    drain_timeout: float = seconds(DEFAULT_DRAIN_TIMEOUT, "on SIGTERM/SIGINT, wait this long for requests in flight",
                                   limit=True, user=True)
    log_level: str = choice("INFO", "the log's level", *LOG_LEVELS, fold=str.upper, user=True)
    log_format: str = choice("text", "text, or json: one JSON object per line", "text", "json", user=True)
    metrics_port: int = count(0, "serve Prometheus metrics on this port (needs the 'metrics' extra)", high=65535,
                              metavar="PORT", zero="off", user=True)
    metrics_host: str = setting(DEFAULT_METRICS_HOST, string, "address the metrics endpoint binds", "ADDRESS")
    group: str | None = setting(None, group_name, "group whose members may use the ipc:// socket (directory 0770, "
                                "socket 0660)", "NAME", security=True, user=True)
    insecure_tcp: bool = switch(False, "allow tcp:// endpoints without CURVE (plaintext, no authentication)",
                                security=True, user=True)
    server_key: str | None = setting(None, existing_path("file"), "CURVE secret key file of the daemon (required "
                                     "for tcp:// without --insecure-tcp)", "PATH", security=True, user=True)
    allow_dir: str | None = setting(None, existing_path("dir"), "directory of the CURVE public keys (NAME.key) of "
                                    "clients let in; needed with --server-key", "PATH", security=True, user=True)
    sim_fault: str | None = setting(None, fault_injection, "testing aid (sim backend only): device DEV turns sticky "
                                    "with ERROR after CALLS more calls", "DEV:CALLS:ERROR")
    #: Give each device its own ROUTER next to every endpoint (:mod:`cuctxd.daemon.worker.lane`), told in hello.
    device_endpoints: bool = switch(True, "give each device its own socket next to each endpoint, so device ops "
                                    "skip a thread hand-off (--no-device-endpoints when only the one socket or port "
                                    "may be used)")
    handshake_timeout: float = seconds(DEFAULT_HANDSHAKE_TIMEOUT, "drop a connection that has not finished its "
                                       "ZeroMQ/CURVE handshake by then", security=True, limit=True)
    #: Microseconds each device worker keeps polling without sleeping after its last request.
    busy_poll_us: int = count(DEFAULT_BUSY_POLL_US, "microseconds each device worker keeps polling, without "
                              "sleeping, after a request: a client's next one is then taken at once, at the cost of "
                              "that CPU time", high=1_000_000, metavar="US",
                              shown="300 on hosts with 8 or more CPUs, else 0")
    sim_vmm: bool = switch(True, "testing aid (sim backend only): the sim's devices have CUDA VMM; with --no-sim-vmm "
                           "they are GPUs without it, whose shareable buffers get IPC pools of their own")
    #: Checkpoints published at start, before ``status`` says ready (:mod:`cuctxd.daemon.service.preload`).
    preload: tuple[Preload, ...] = setting((), preload_list, "a checkpoint to load and publish at start, before "
                                           "the daemon says ready (a missing or bad one is logged and skipped): "
                                           "NAME=PATH[@DEVICE,...], in the file also a table {name, path, devices}; "
                                           "repeatable", "NAME=PATH", from_text=preload_entry, render=preload_texts,
                                           repeat=True, shown="none", user=True)
    #: Kubernetes (:mod:`cuctxd.daemon.kubelet.pod_gpus`): each session limited to its client pod's GPUs.
    gpu_limit: bool = switch(False, "limit each session to the GPUs the kubelet gave its client's pod (Kubernetes: "
                             "asks the API server and the kubelet's PodResources API; needs the kubernetes extra)",
                             security=True, user=True)
    gpu_resource: str = setting("nvidia.com/gpu", string, "with gpu_limit: the resource whose device ids are the "
                                "pod's GPU UUIDs", "NAME", security=True)
    pod_resources_socket: str = setting(POD_RESOURCES_SOCKET, string, "with gpu_limit: the kubelet's "
                                        "PodResources socket", "PATH", security=True)
    kubernetes_api: str | None = setting(None, string, "with gpu_limit: the API server's URL", "URL",
                                  shown="in-cluster: KUBERNETES_SERVICE_HOST, the pod's service account", security=True)

    @property
    def tcp_endpoints(self) -> tuple[str, ...]:
        return tuple(e for e in self.endpoints if e.startswith("tcp://"))


def check_config(config: DaemonConfig, from_flags: Collection[str] = ()) -> None:
    """Checks that span keys; raises :class:`ConfigError` naming the key to change, or the flag where the
    value came from the command line (``from_flags``: the settings given as flags).

    tcp:// is refused unless CURVE can protect it (``server_key``) or the
    operator accepted plaintext (``insecure_tcp``): anyone who reaches a tcp
    port could otherwise use, and read the memory of, every GPU served.
    """
    tcp = config.tcp_endpoints
    if tcp and config.server_key is None and not config.insecure_tcp:
        if "endpoints" in from_flags:
            raise ConfigError("endpoints", f"{tcp[0]} is a tcp:// endpoint, which needs CURVE keys (--server-key "
                              "FILE --allow-dir DIR, made with 'cuctxd keygen') or, to accept plaintext on purpose, "
                              "--insecure-tcp", flag="--endpoint")
        raise ConfigError(
            "endpoints",
            f"{tcp[0]} is a tcp:// endpoint, which needs server_key (CURVE encryption and "
            "authentication) or, to accept plaintext on purpose, insecure_tcp = true (--insecure-tcp)",
        )


#: Every setting by name (its configuration-file key), in field order.
SETTINGS: dict[str, Setting] = declared(DaemonConfig)
