"""The daemon's effective configuration, and parsing of human sizes like ``8GiB``.

:class:`DaemonConfig` is built once at start (defaults, then the ``--config``
TOML file, then command-line flags: see :mod:`cuctxd.daemon.service.config_file`) and only read
afterwards. Every value is checked by the converters in :mod:`cuctxd.daemon.service.config_file`
before it gets here; :func:`check_config` adds the checks that span keys.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from cuctxd.daemon.device.queues import (
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_MAX_REPLY_BYTES_PER_PEER,
)
from cuctxd.daemon.device.shm_lanes import DEFAULT_MAX_SHM_LANES
from cuctxd.daemon.registry.shares import DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION, DEFAULT_MAX_MANIFEST_BYTES_PER_UID
from cuctxd.daemon.registry.tickets import DEFAULT_MAX_TICKETS_PER_SESSION, DEFAULT_TICKET_TTL
from cuctxd.daemon.side_channel.server import DEFAULT_MAX_FD_CONNECTIONS, DEFAULT_MAX_FD_CONNECTIONS_PER_PEER
from cuctxd.protos.limits import DEFAULT_MAX_PAYLOAD_BYTES
from cuctxd.protos.shm_lane import polls_busily

#: Size suffixes, as docker and systemd read them: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024;
#: only an explicit KB/MB/GB/TB is decimal. Case does not matter.
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
#: What ``--help`` says a SIZE is.
SIZE_HELP = ("SIZE is bytes, or a number with K, M, G, T (also KiB, MiB, GiB, TiB: powers of 1024, "
             "512M = 512MiB) or KB, MB, GB, TB (powers of 1000)")
#: The units :func:`format_size` may write; binary first, so it wins a tie.
_RENDER_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                 ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000))
#: Seconds a published buffer whose owner left waits for a consumer before it is freed.
DEFAULT_ORPHAN_TTL = 600.0
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

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` and ``"512M"`` -> 536870912, ``"1GB"`` -> 10**9; plain integers are bytes. ValueError on garbage."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str | int:
    """The inverse of :func:`parse_size`, exact and short: ``512M`` -> ``"512MiB"``, ``2GB`` -> ``"2GB"``.

    Of the units that divide ``n``, the one leaving the fewest digits (binary on a tie); ``n`` itself
    when none does.
    """
    best: str | int = n
    digits = len(str(n)) + 1
    for unit, factor in _RENDER_UNITS:
        if n >= factor and n % factor == 0 and len(str(n // factor)) < digits:
            best, digits = f"{n // factor}{unit}", len(str(n // factor))
    return best


class ConfigError(ValueError):
    """A configuration value is wrong; ``key`` names it as the TOML file spells it."""

    def __init__(self, key: str, message: str, source: str | None = None) -> None:
        self.key = key
        self.source = source
        where = f" (in {source})" if source else ""
        super().__init__(f"configuration key '{key}'{where}: {message}")


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon needs to start; built by the CLI, used read-only afterwards.

    ``devices``: the driver ordinals to serve, in the order clients see them as
    devices 0..n-1 (None: every device). ``0`` for a size, count or port means
    "none"/"off". ``group`` .. ``max_objects_per_session`` are the security and
    limit settings: parsed and checked here, enforced by the daemon where the
    module docstring of :mod:`cuctxd.daemon.service.server` says.
    """

    endpoints: tuple[str, ...]
    backend: str = "auto"
    sim_devices: int = 2
    sim_memory: int = 1 << 30
    devices: tuple[int, ...] | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES
    lease_ttl: float = DEFAULT_LEASE_TTL
    session_quota: int = 0
    device_reserve: int = 0
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_port: int = 0
    metrics_host: str = DEFAULT_METRICS_HOST
    group: str | None = None
    insecure_tcp: bool = False
    server_key: str | None = None
    allow_dir: str | None = None
    max_sessions_per_peer: int = 0
    max_objects_per_session: int = DEFAULT_MAX_OBJECTS_PER_SESSION
    orphan_ttl: float = DEFAULT_ORPHAN_TTL
    sim_fault: str | None = None
    #: Give each device its own ROUTER next to every endpoint (:mod:`cuctxd.daemon.device.lane`), told in hello.
    device_endpoints: bool = True
    #: Per session and device (:mod:`cuctxd.daemon.device.queues`): requests queued, their payload bytes,
    #: and reply payload bytes its client has not taken.
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    #: Contexts one session may create per device; exports + share holds per session per device;
    #: published shares whose owner is gone and nobody holds, daemon-wide (the oldest are freed beyond it).
    max_contexts_per_session: int = DEFAULT_MAX_CONTEXTS_PER_SESSION
    max_shares_per_session: int = DEFAULT_MAX_SHARES_PER_SESSION
    max_orphaned_shares: int = DEFAULT_MAX_ORPHANED_SHARES
    #: Most client connections on all sockets together (0: what the open-file limit leaves,
    #: :func:`cuctxd.daemon.intake.connections.connection_cap`).
    max_connections: int = 0
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: Bytes of host buffers per session and device, and of all sessions' per device (pinned memory).
    host_memory_per_session: int = DEFAULT_HOST_MEMORY_PER_SESSION
    max_host_memory: int = DEFAULT_MAX_HOST_MEMORY
    #: The fd channel (:mod:`cuctxd.daemon.side_channel`): connections at once, a ticket's life, and
    #: tickets one session may have waiting.
    max_fd_connections: int = DEFAULT_MAX_FD_CONNECTIONS
    fd_ticket_ttl: float = DEFAULT_TICKET_TTL
    max_tickets_per_session: int = DEFAULT_MAX_TICKETS_PER_SESSION
    #: Shm lanes open to one device at once (:mod:`cuctxd.daemon.device.shm_lanes`).
    max_shm_lanes: int = DEFAULT_MAX_SHM_LANES
    #: Microseconds each device worker keeps polling without sleeping after its last request.
    busy_poll_us: int = DEFAULT_BUSY_POLL_US
    #: Fds the daemon may hold for clients (tickets, shm lanes, host buffers, fd channel connections): in all,
    #: per peer, per session; 0: derived from the open-file limit
    #: (:class:`cuctxd.daemon.registry.fd_budget.FdPlan`). And fd channel connections of one peer.
    max_client_fds: int = 0
    max_client_fds_per_peer: int = 0
    max_client_fds_per_session: int = 0
    max_fd_connections_per_peer: int = DEFAULT_MAX_FD_CONNECTIONS_PER_PEER
    #: Open sessions of one uid, all its processes together (peers whose uid the kernel tells: ipc://).
    max_sessions_per_uid: int = 0
    #: Bytes of published buffers whose owner is gone and nobody holds, per owner uid and device
    #: (0: half the device's memory).
    max_orphaned_bytes_per_uid: int = 0
    #: Bytes of published names (manifests included), per publishing session and per uid, daemon-wide.
    max_manifest_bytes_per_session: int = DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION
    max_manifest_bytes_per_uid: int = DEFAULT_MAX_MANIFEST_BYTES_PER_UID
    #: Reply payload bytes a peer's clients have not taken, all its sessions together, per device.
    max_reply_bytes_per_peer: int = DEFAULT_MAX_REPLY_BYTES_PER_PEER
    #: What ``status`` (``node``) and the metrics (``cuctxd_info{node}``) call the machine this daemon serves.
    node_name: str = DEFAULT_NODE_NAME

    @property
    def tcp_endpoints(self) -> tuple[str, ...]:
        return tuple(e for e in self.endpoints if e.startswith("tcp://"))


def check_config(config: DaemonConfig) -> None:
    """Checks that span keys; raises :class:`ConfigError` naming the key to change.

    tcp:// is refused unless CURVE can protect it (``server_key``) or the
    operator accepted plaintext (``insecure_tcp``): anyone who reaches a tcp
    port could otherwise use, and read the memory of, every GPU served.
    """
    tcp = config.tcp_endpoints
    if tcp and config.server_key is None and not config.insecure_tcp:
        raise ConfigError(
            "endpoints",
            f"{tcp[0]} is a tcp:// endpoint, which needs server_key (CURVE encryption and "
            "authentication) or, to accept plaintext on purpose, insecure_tcp = true (--insecure-tcp)",
        )
