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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.connection_budget import ConnectionBudget
from cuctxd.daemon.registry.fd_budget import FdBudget
from cuctxd.daemon.registry.sessions import SessionRegistry
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.records import DeviceInfo


class FdChannel(Protocol):
    """What the front ops read of the fd channel (:class:`~cuctxd.daemon.side_channel.server.SideChannel`):
    its socket paths, told in ``hello``, and its counts, shown by ``status``. Said here so that the
    daemon-wide state does not import the fd channel's thread, which imports the registries."""

    paths: list[str]

    def stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AdmissionConfig:
    """The settings the front and each device endpoint's admission apply, taken from the daemon's configuration."""

    lease_ttl: float
    orphan_ttl: float
    max_payload: int
    max_sessions_per_peer: int = 0
    max_sessions_per_uid: int = 0
    #: As configured (``status`` shows them); the endpoints bound are :attr:`DaemonState.endpoints`.
    endpoints: tuple[str, ...] = ()
    #: The driver ordinal of each device served, by index.
    device_ordinals: tuple[int, ...] = ()
    #: Per session and device: queued requests and unread replies (:mod:`cuctxd.daemon.worker.queues`).
    queue_limits: QueueLimits = field(default_factory=QueueLimits)
    #: What ``status`` and the metrics call the machine (``node_name``).
    node_name: str = ""


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
    #: ``gpu_limit`` (:class:`cuctxd.daemon.kubelet.pod_gpus.GpuLimit`): the devices a peer's pid may use, None
    #: for all; raises DeviceNotAllowed. Called by hello on the front thread. None: every session may use all.
    device_limit: Callable[[int | None], frozenset[int] | None] | None = None
    #: False while the daemon preloads its checkpoints (``preload``; the preload thread sets it once, when done):
    #: ``status`` says it, the readiness probe asks.
    ready: bool = True
