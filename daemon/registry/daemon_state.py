"""Daemon-wide state: sessions, the device list, the endpoints, ``draining`` and the settings admission applies.

The front thread owns it and writes it; every ROUTER's admission reads it
(:mod:`cuctxd.daemon.intake.admission`, on the front and on each device worker's
own ROUTER, :mod:`cuctxd.daemon.worker.lane`), and the front ops' handlers
(:mod:`cuctxd.daemon.handlers.session_ops`, :mod:`~cuctxd.daemon.handlers.sharing_ops`)
answer from it. It lives here, beside the other registries, and not in ``front/``,
so that no device, intake or handler code imports the front thread's package.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.connection_budget import ConnectionBudget
from cuctxd.daemon.registry.fd_budget import FdBudget
from cuctxd.daemon.registry.sessions import SessionRegistry
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.settings import count, seconds, setting, size, string
from cuctxd.protos.limits import DEFAULT_MAX_PAYLOAD_BYTES
from cuctxd.protos.records import DeviceInfo


class DeviceLookup(Protocol):
    """The devices a session may use, still to be asked of services outside the daemon (``gpu_limit``: the API
    server, the kubelet): called on the front's lookup pool (:mod:`cuctxd.daemon.front.lookups`), never on the
    front thread; raises DeviceNotAllowed. Lookups with one ``key`` (one pod) are asked once."""

    @property
    def key(self) -> str: ...

    def __call__(self) -> frozenset[int]: ...


#: ``gpu_limit`` (:class:`cuctxd.daemon.kubelet.pod_gpus.GpuLimit`): for a peer's pid, the devices it may use
#: (None: all), or the :class:`DeviceLookup` that will say; raises DeviceNotAllowed. Front thread, at hello.
DeviceLimit = Callable[[int | None], "frozenset[int] | DeviceLookup | None"]


class FdChannel(Protocol):
    """What the front ops read of the fd channel (:class:`~cuctxd.daemon.side_channel.server.SideChannel`):
    its socket paths, told in ``hello``, and its counts, shown by ``status``. Said here so that the
    daemon-wide state does not import the fd channel's thread, which imports the registries."""

    paths: list[str]

    def stats(self) -> dict[str, Any]: ...


#: Seconds a session lives without a request or heartbeat before it is reaped.
DEFAULT_LEASE_TTL = 5.0
#: Seconds a published buffer whose owner left waits for a consumer before it is freed.
DEFAULT_ORPHAN_TTL = 600.0
#: The machine ``status`` and the metrics name (``node_name``): the host name, unless a cluster says better
#: (in a Kubernetes pod the host name is the pod's; the DaemonSet passes the node's name).
DEFAULT_NODE_NAME = socket.gethostname()


@dataclass(frozen=True)
class PayloadLimit:
    """The largest payload frame: the front's admission and each device's reads and writes check it, the
    sockets refuse larger messages (its one declaration, which both :class:`AdmissionLimits` and
    :class:`~cuctxd.daemon.device.entries.DeviceLimits` inherit)."""

    max_payload: int = size(DEFAULT_MAX_PAYLOAD_BYTES, "largest payload frame a request or reply may carry",
                            minimum=1, limit=True)


@dataclass(frozen=True)
class AdmissionLimits(PayloadLimit):
    """The settings the front and each device endpoint's admission apply (:mod:`cuctxd.daemon.settings`)."""

    lease_ttl: float = seconds(DEFAULT_LEASE_TTL, "reap a session after this long without a request or heartbeat",
                               limit=True, user=True)
    orphan_ttl: float = seconds(DEFAULT_ORPHAN_TTL, "free a published buffer whose owner left after this long "
                                "without a consumer", limit=True, user=True)
    max_sessions_per_peer: int = count(0, "most sessions one peer may hold open", zero="no limit", security=True,
                                       limit=True)
    #: Open sessions of one uid, all its processes together (peers whose uid the kernel tells: ipc://).
    max_sessions_per_uid: int = count(0, "most sessions the processes of one user may hold open together, where "
                                      "the kernel tells the user (ipc://)", zero="no limit", security=True,
                                      limit=True)
    #: What ``status`` (``node``) and the metrics (``cuctxd_info{node}``) call the machine this daemon serves.
    node_name: str = setting(DEFAULT_NODE_NAME, string, "what status and the metrics call this machine (in a "
                             "Kubernetes pod, pass the node's name)", "NAME", shown="the host name", user=True)


@dataclass(frozen=True)
class AdmissionConfig(AdmissionLimits):
    """:class:`AdmissionLimits` and what the daemon's assembly adds to them: the endpoints, the devices and
    the queue limits the front checks."""

    #: As configured (``status`` shows them); the endpoints bound are :attr:`DaemonState.endpoints`.
    endpoints: tuple[str, ...] = ()
    #: The driver ordinal of each device served, by index.
    device_ordinals: tuple[int, ...] = ()
    #: Per session and device: queued requests and unread replies (:mod:`cuctxd.daemon.worker.queues`).
    queue_limits: QueueLimits = field(default_factory=QueueLimits)


@dataclass
class DaemonState:
    """Owned by the front thread; device workers' lanes (their ROUTERs) read it (:mod:`cuctxd.daemon.intake.admission`).

    Everything here is written on the front thread only, but for what
    :class:`~cuctxd.daemon.registry.sessions.Session` says a lane may write, and
    ``draining``, set by the daemon (on the front thread too, between serve calls).
    """

    config: AdmissionConfig
    backend: str
    devices: list[DeviceInfo]
    shares: ShareRegistry
    sessions: SessionRegistry = field(default_factory=SessionRegistry)
    sessions_reaped: int = 0
    #: The endpoints the front's ROUTER bound, and per device those its own ROUTER bound next to each
    #: (same order; empty when ``device_endpoints`` is off); both told to clients in hello.
    endpoints: list[str] = field(default_factory=list)
    device_endpoints: list[list[str]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    #: Random per daemon start: ``hello`` says it, so a client tells a restarted daemon from the one it knew.
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    #: Set by the daemon when a shutdown starts: every new request is answered ShuttingDown.
    draining: bool = False
    #: Client connections on every ROUTER against ``max_connections`` (``status`` shows them).
    connections: ConnectionBudget | None = None
    #: The fd channel beside the ipc:// endpoints (None without one): its path goes out in hello.
    fd_channel: FdChannel | None = None
    #: The fds the daemon holds for clients against its open-file limit (``status`` shows them).
    fd_budget: FdBudget | None = None
    #: Starts the daemon's shutdown as SIGTERM does (the op ``shutdown``); its argument says who asked, for the
    #: log. Set by the daemon; None: the op is refused (a front run without a daemon around it, in tests).
    request_stop: Callable[[str], None] | None = None
    #: ``gpu_limit``: the devices a peer's pid may use (:data:`DeviceLimit`). None: every session may use all.
    device_limit: DeviceLimit | None = None
    #: ``gpu_limit``'s lookup pool as ``status`` shows it (``pod_lookups``; front thread); set with the pool.
    lookup_status: Callable[[], dict[str, int]] | None = None
    #: False while the daemon preloads its checkpoints (``preload``; the preload thread sets it once, when done):
    #: ``status`` says it, the readiness probe asks.
    ready: bool = True
