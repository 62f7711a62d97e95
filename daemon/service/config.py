"""The daemon's effective configuration: every setting, declared once, as a field of :class:`DaemonConfig`.

:class:`DaemonConfig` is built once at start (defaults, then the ``--config``
TOML file, then command-line flags: see :mod:`cuctxd.daemon.service.config_file`) and only read
afterwards. Each field is made by a declaration of :mod:`cuctxd.daemon.service.settings`, which
holds its default, the check every value goes through before it gets here, its ``--help`` and
whether it is a row of PROTOCOL.md's limits table; the file's keys (:data:`SETTINGS`) and the
command line's flags (:mod:`cuctxd.daemon.service.cli`) are made from those.
:func:`check_config` adds the checks that span keys.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection
from dataclasses import dataclass

from cuctxd.daemon.device.shm_lanes import DEFAULT_MAX_SHM_LANES
from cuctxd.daemon.front.lookups import DEFAULT_MAX_PENDING_HELLOS, DEFAULT_MAX_POD_LOOKUPS
from cuctxd.daemon.kubelet import POD_RESOURCES_SOCKET
from cuctxd.daemon.registry.backlogs import (
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_MAX_REPLY_BYTES_PER_PEER,
)
from cuctxd.daemon.registry.shares import (
    DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION,
    DEFAULT_MAX_MANIFEST_BYTES_PER_UID,
    DEFAULT_MAX_NAMES_PER_UID,
)
from cuctxd.daemon.registry.tickets import DEFAULT_MAX_TICKETS_PER_SESSION, DEFAULT_TICKET_TTL
from cuctxd.daemon.service.preload import Preload, preload_entry, preload_list, preload_texts
from cuctxd.daemon.service.settings import (
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
from cuctxd.daemon.side_channel.server import DEFAULT_MAX_FD_CONNECTIONS, DEFAULT_MAX_FD_CONNECTIONS_PER_PEER
from cuctxd.protos.endpoints import default_endpoint
from cuctxd.protos.limits import DEFAULT_MAX_PAYLOAD_BYTES
from cuctxd.protos.shm_lane import polls_busily

#: Seconds a published buffer whose owner left waits for a consumer before it is freed.
DEFAULT_ORPHAN_TTL = 600.0
#: Seconds a device's primary context is kept after its last user let go: making one again took 120-180 ms on
#: the H200 (every new client process's first op paid it when the daemon was otherwise idle).
DEFAULT_PRIMARY_KEEP = 60.0
DEFAULT_KEPT_HOST_MEMORY = 256 << 20
#: Object limits that protect a shared machine (PROTOCOL.md, "Limits"); 0 in the configuration means none.
DEFAULT_MAX_OBJECTS_PER_SESSION = 16384
DEFAULT_MAX_CONTEXTS_PER_SESSION = 64
DEFAULT_MAX_SHARES_PER_SESSION = 1024
DEFAULT_MAX_ORPHANED_SHARES = 4096
#: Bytes of host buffers (``host_alloc``, staging rings) one session may have on each device.
DEFAULT_HOST_MEMORY_PER_SESSION = 4 << 30


def _quarter_of_memory() -> int:
    """A quarter of the host's physical memory: what host buffers of all sessions may pin per device."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (OSError, ValueError):
        return 16 << 30


DEFAULT_MAX_HOST_MEMORY = _quarter_of_memory()


def _busy_poll_for_host() -> int:
    """Microseconds a device worker polls without sleeping after a request: 300 on hosts with 8 CPUs or
    more, 0 on smaller ones, where a polling thread takes the CPU a client needs (CUDA's
    ``CU_CTX_SCHED_AUTO`` spins or yields by the same reasoning)."""
    return 300 if polls_busily() else 0


DEFAULT_BUSY_POLL_US = _busy_poll_for_host()

#: Seconds a session lives without a request or heartbeat before it is reaped.
DEFAULT_LEASE_TTL = 5.0
#: Seconds a SIGTERM/SIGINT drain may take before the daemon gives up on in-flight work.
DEFAULT_DRAIN_TIMEOUT = 10.0
#: Seconds a new connection may take to finish its ZeroMQ (and CURVE) handshake before it is dropped.
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: Where the metrics endpoint listens unless told otherwise: this host only.
DEFAULT_METRICS_HOST = "127.0.0.1"
#: The machine ``status`` and the metrics name (``node_name``): the host name, unless a cluster says better
#: (in a Kubernetes pod the host name is the pod's; the DaemonSet passes the node's name).
DEFAULT_NODE_NAME = socket.gethostname()

class ConfigError(ValueError):
    """A configuration value is wrong; ``key`` names it as the TOML file spells it."""

    def __init__(self, key: str, message: str, source: str | None = None, *, flag: str | None = None) -> None:
        """``flag``: the value came from the command line, as this flag: the message names it instead of the key."""
        self.key = key
        self.source = source
        where = f" (in {source})" if source else ""
        super().__init__(f"{flag}: {message}" if flag else f"configuration key '{key}'{where}: {message}")


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon needs to start; built by the CLI, used read-only afterwards.

    ``devices``: the driver ordinals to serve, in the order clients see them as
    devices 0..n-1 (None: every device). ``0`` for a size, count or port means
    "none"/"off". ``group`` .. ``max_sessions_per_uid`` are the security and
    limit settings: parsed and checked here, enforced by the daemon where the
    module docstring of :mod:`cuctxd.daemon.service.server` says. Each field is its
    setting's one declaration (:mod:`cuctxd.daemon.service.settings`); new ones go at the end.
    """

    endpoints: tuple[str, ...] = setting(
        NO_DEFAULT, endpoint_list, "where to listen: ipc://PATH or tcp://HOST:PORT (PORT * takes any free port); "
        "repeatable", "URL", from_text=check_endpoint, render=list, shown=default_endpoint, flag_name="--endpoint",
        repeat=True)
    backend: str = choice("auto", "driver backend; auto uses cuda when a driver and a device are present",
                          "auto", "cuda", "sim")
    sim_devices: int = count(2, "devices of the sim backend", low=1, high=MAX_SIM_DEVICES)
    sim_memory: int = size(1 << 30, "memory per sim device", minimum=1)
    devices: tuple[int, ...] | None = setting(
        None, ordinals, "serve only these driver ordinals, e.g. 2,0; clients see them as devices 0..n-1",
        "ORDINALS", from_text=ordinals_text, render=list, shown="all")
    max_payload: int = size(DEFAULT_MAX_PAYLOAD_BYTES, "largest payload frame a request or reply may carry",
                            minimum=1, limit=True)
    lease_ttl: float = seconds(DEFAULT_LEASE_TTL, "reap a session after this long without a request or heartbeat",
                               limit=True)
    session_quota: int = size(0, "most memory one session may hold on each device", zero="no quota", limit=True)
    device_reserve: int = size(0, "memory of each device that allocations must leave free", limit=True)
    drain_timeout: float = seconds(DEFAULT_DRAIN_TIMEOUT, "on SIGTERM/SIGINT, wait this long for requests in flight",
                                   limit=True)
    log_level: str = choice("INFO", "the log's level", *LOG_LEVELS, fold=str.upper)
    log_format: str = choice("text", "text, or json: one JSON object per line", "text", "json")
    metrics_port: int = count(0, "serve Prometheus metrics on this port (needs the 'metrics' extra)", high=65535,
                              metavar="PORT", zero="off")
    metrics_host: str = setting(DEFAULT_METRICS_HOST, string, "address the metrics endpoint binds", "ADDRESS")
    group: str | None = setting(None, group_name, "group whose members may use the ipc:// socket (directory 0770, "
                                "socket 0660)", "NAME", security=True)
    insecure_tcp: bool = switch(False, "allow tcp:// endpoints without CURVE (plaintext, no authentication)",
                                security=True)
    server_key: str | None = setting(None, existing_path("file"), "CURVE secret key file of the daemon (required "
                                     "for tcp:// without --insecure-tcp)", "PATH", security=True)
    allow_dir: str | None = setting(None, existing_path("dir"), "directory of the CURVE public keys (NAME.key) of "
                                    "clients let in; needed with --server-key", "PATH", security=True)
    max_sessions_per_peer: int = count(0, "most sessions one peer may hold open", zero="no limit", security=True,
                                       limit=True)
    max_objects_per_session: int = count(
        DEFAULT_MAX_OBJECTS_PER_SESSION, "most contexts, buffers, streams, events and share holds one session may "
        "have on each device", zero="no limit", security=True, limit=True)
    orphan_ttl: float = seconds(DEFAULT_ORPHAN_TTL, "free a published buffer whose owner left after this long "
                                "without a consumer", limit=True)
    primary_keep: float = seconds(DEFAULT_PRIMARY_KEEP, "keep a device's primary context this long after its last "
                                  "session or share let go, so that the next session need not wait for a new one "
                                  "(its memory stays held meanwhile)", zero="release it at once", limit=True)
    kept_host_memory: int = size(DEFAULT_KEPT_HOST_MEMORY, "bytes of freed host buffers (of 1 MiB or more, at most "
                                 "4) kept page-locked on each device for primary_keep seconds, for the next "
                                 "host_alloc of the same size and user that accepts reused memory (cuctx load's "
                                 "ring)", zero="none kept", limit=True)
    sim_fault: str | None = setting(None, fault_injection, "testing aid (sim backend only): device DEV turns sticky "
                                    "with ERROR after CALLS more calls", "DEV:CALLS:ERROR")
    #: Give each device its own ROUTER next to every endpoint (:mod:`cuctxd.daemon.worker.lane`), told in hello.
    device_endpoints: bool = switch(True, "give each device its own socket next to each endpoint, so device ops "
                                    "skip a thread hand-off (--no-device-endpoints when only the one socket or port "
                                    "may be used)")
    #: Per session and device (:mod:`cuctxd.daemon.worker.queues`): requests queued, their payload bytes,
    #: and reply payload bytes its client has not taken.
    max_queued_requests: int = count(DEFAULT_MAX_QUEUED_REQUESTS, "most requests one session may have queued on "
                                     "each device", zero="no limit", security=True, limit=True)
    max_queued_bytes: int = size(DEFAULT_MAX_QUEUED_BYTES, "most payload bytes one session may have queued on each "
                                 "device, beyond its first request", zero="no limit", security=True, limit=True)
    max_reply_bytes: int = size(DEFAULT_MAX_REPLY_BYTES, "read results one session's client may leave untaken on "
                                "each device before its reads are refused", zero="no limit", security=True,
                                limit=True)
    #: Contexts one session may create per device; exports + share holds per session per device;
    #: published shares whose owner is gone and nobody holds, daemon-wide (the oldest are freed beyond it).
    max_contexts_per_session: int = count(DEFAULT_MAX_CONTEXTS_PER_SESSION, "most contexts one session may create "
                                          "on each device", zero="no limit", security=True, limit=True)
    max_shares_per_session: int = count(DEFAULT_MAX_SHARES_PER_SESSION, "most shares one session may have exported "
                                        "plus held open on each device", zero="no limit", security=True, limit=True)
    max_orphaned_shares: int = count(DEFAULT_MAX_ORPHANED_SHARES, "most published buffers whose owner left and "
                                     "nobody holds, daemon-wide; beyond it the oldest are freed", zero="no limit",
                                     security=True, limit=True)
    #: Most client connections on all sockets together (0: what the open-file limit leaves,
    #: :func:`cuctxd.daemon.intake.connections.connection_cap`).
    max_connections: int = count(0, "most client connections at once; beyond it new ones are refused until some "
                                 "close", shown="0: half of what the open-file limit leaves once a quarter of it is "
                                 "kept for the daemon; the other half is max_client_fds", security=True, limit=True)
    handshake_timeout: float = seconds(DEFAULT_HANDSHAKE_TIMEOUT, "drop a connection that has not finished its "
                                       "ZeroMQ/CURVE handshake by then", security=True, limit=True)
    #: Bytes of host buffers per session and device, and of all sessions' per device (pinned memory).
    host_memory_per_session: int = size(DEFAULT_HOST_MEMORY_PER_SESSION, "bytes of host buffers (host_alloc, "
                                        "staging rings) one session may have on each device", zero="no limit",
                                        security=True, limit=True)
    max_host_memory: int = size(DEFAULT_MAX_HOST_MEMORY, "bytes of host buffers of all sessions on each device, "
                                "pinned memory", shown="a quarter of the host's memory", zero="no limit",
                                security=True, limit=True)
    #: The fd channel (:mod:`cuctxd.daemon.side_channel`): connections at once, a ticket's life, and
    #: tickets one session may have waiting.
    max_fd_connections: int = count(DEFAULT_MAX_FD_CONNECTIONS, "most connections to the fd channel at once",
                                    security=True, limit=True)
    fd_ticket_ttl: float = seconds(DEFAULT_TICKET_TTL, "how long a ticket for the fd channel stays redeemable",
                                   security=True, limit=True)
    max_tickets_per_session: int = count(DEFAULT_MAX_TICKETS_PER_SESSION, "fd channel tickets one session may have "
                                         "waiting", zero="no limit", security=True, limit=True)
    #: Shm lanes open to one device at once (:mod:`cuctxd.daemon.device.shm_lanes`).
    max_shm_lanes: int = count(DEFAULT_MAX_SHM_LANES, "shm lanes open to each device at once; beyond, sessions use "
                               "the socket", zero="no limit", security=True, limit=True)
    #: Microseconds each device worker keeps polling without sleeping after its last request.
    busy_poll_us: int = count(DEFAULT_BUSY_POLL_US, "microseconds each device worker keeps polling, without "
                              "sleeping, after a request: a client's next one is then taken at once, at the cost of "
                              "that CPU time", high=1_000_000, metavar="US",
                              shown="300 on hosts with 8 or more CPUs, else 0")
    #: Fds the daemon may hold for clients (tickets, shm lanes, host buffers, fd channel connections): in all,
    #: per peer, per session; 0: derived from the open-file limit
    #: (:class:`cuctxd.daemon.registry.fd_budget.FdPlan`). And fd channel connections of one peer.
    max_client_fds: int = count(0, "most fds the daemon holds for clients (tickets, shm lanes, host buffers, fd "
                                "channel connections)", shown="0: the open-file limit N less the daemon's reserve "
                                "max(N/4, min(128, N/2)) less max_connections", security=True, limit=True)
    max_client_fds_per_peer: int = count(0, "of those, most held for one peer: a process, or a group member's uid",
                                         shown="0: a quarter of max_client_fds", security=True, limit=True)
    max_client_fds_per_session: int = count(0, "of those, most held for one session",
                                            shown="0: an eighth of max_client_fds (at most the peer's share)",
                                            security=True, limit=True)
    max_fd_connections_per_peer: int = count(DEFAULT_MAX_FD_CONNECTIONS_PER_PEER, "most fd channel connections of "
                                             "one peer at once", zero="no limit", security=True, limit=True)
    #: Open sessions of one uid, all its processes together (peers whose uid the kernel tells: ipc://).
    max_sessions_per_uid: int = count(0, "most sessions the processes of one user may hold open together, where "
                                      "the kernel tells the user (ipc://)", zero="no limit", security=True,
                                      limit=True)
    #: Bytes of published buffers whose owner is gone and nobody holds, per owner uid and device
    #: (0: the device's memory).
    max_orphaned_bytes_per_uid: int = size(0, "bytes of published buffers whose owner left and nobody holds, per "
                                           "user and device; publish is refused beyond it",
                                           shown="0: the device's memory", security=True, limit=True)
    #: Bytes of published names (manifests included), per publishing session and per uid, daemon-wide.
    max_manifest_bytes_per_session: int = size(DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION, "bytes of the names "
                                               "(manifests included) one session may have published",
                                               zero="no limit", security=True, limit=True)
    max_manifest_bytes_per_uid: int = size(DEFAULT_MAX_MANIFEST_BYTES_PER_UID, "bytes of the names (manifests "
                                           "included) one user's sessions may have published, ended ones included",
                                           zero="no limit", security=True, limit=True)
    #: Reply payload bytes a peer's clients have not taken, all its sessions together, per device.
    max_reply_bytes_per_peer: int = size(DEFAULT_MAX_REPLY_BYTES_PER_PEER, "read results one peer's clients may "
                                         "leave untaken on each device, all its sessions together, before their "
                                         "reads are refused", zero="no limit", security=True, limit=True)
    #: Published names of one uid's sessions, ended ones included, daemon-wide.
    max_names_per_uid: int = count(DEFAULT_MAX_NAMES_PER_UID, "names one user's sessions may have published, "
                                   "ended ones included", zero="no limit", security=True, limit=True)
    #: fds of the service manager's fd store one uid's parked shares may hold (two each; 0: a quarter of the store).
    max_parked_fds_per_uid: int = count(0, "most fds of the service manager's fd store one user's parked "
                                        "(persistent) shares may hold, two each", shown="0: a quarter of the "
                                        "store ($FDSTORE)", security=True, limit=True)
    #: What ``status`` (``node``) and the metrics (``cuctxd_info{node}``) call the machine this daemon serves.
    node_name: str = setting(DEFAULT_NODE_NAME, string, "what status and the metrics call this machine (in a "
                             "Kubernetes pod, pass the node's name)", "NAME", shown="the host name")
    sim_vmm: bool = switch(True, "testing aid (sim backend only): the sim's devices have CUDA VMM; with --no-sim-vmm "
                           "they are GPUs without it, whose shareable buffers get IPC pools of their own")
    #: Checkpoints published at start, before ``status`` says ready (:mod:`cuctxd.daemon.service.preload`).
    preload: tuple[Preload, ...] = setting((), preload_list, "a checkpoint to load and publish at start, before "
                                           "the daemon says ready (a missing or bad one is logged and skipped): "
                                           "NAME=PATH[@DEVICE,...], in the file also a table {name, path, devices}; "
                                           "repeatable", "NAME=PATH", from_text=preload_entry, render=preload_texts,
                                           repeat=True, shown="none")
    #: Kubernetes (:mod:`cuctxd.daemon.kubelet.pod_gpus`): each session limited to its client pod's GPUs.
    gpu_limit: bool = switch(False, "limit each session to the GPUs the kubelet gave its client's pod (Kubernetes: "
                             "asks the API server and the kubelet's PodResources API; needs the kubernetes extra)",
                             security=True)
    gpu_resource: str = setting("nvidia.com/gpu", string, "with gpu_limit: the resource whose device ids are the "
                                "pod's GPU UUIDs", "NAME", security=True)
    pod_resources_socket: str = setting(POD_RESOURCES_SOCKET, string, "with gpu_limit: the kubelet's "
                                        "PodResources socket", "PATH", security=True)
    kubernetes_api: str | None = setting(None, string, "with gpu_limit: the API server's URL", "URL",
                                  shown="in-cluster: KUBERNETES_SERVICE_HOST, the pod's service account", security=True)
    #: gpu_limit's lookup pool (:mod:`cuctxd.daemon.front.lookups`): lookups at once, hellos waiting on one.
    max_pod_lookups: int = count(DEFAULT_MAX_POD_LOOKUPS, "with gpu_limit: pods' first hellos looked up at once "
                                 "(the API server, the kubelet), each on a thread of its own", low=1, security=True,
                                 limit=True)
    max_pending_hellos: int = count(DEFAULT_MAX_PENDING_HELLOS, "with gpu_limit: hellos waiting on their pod's "
                                    "lookup at once, all pods together", low=1, security=True, limit=True)

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
