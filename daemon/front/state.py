"""What the front thread knows: sessions, the device list, the backend, limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cuctxd.daemon.registry.sessions import SessionRegistry
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.service.config import DaemonConfig
from cuctxd.protos.records import DeviceInfo


@dataclass
class FrontState:
    """Owned by the front thread; device workers' lanes read it (:mod:`cuctxd.daemon.intake.admission`)."""

    config: DaemonConfig
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
    #: Set by the daemon when a shutdown starts: every new request is answered ShuttingDown.
    draining: bool = False
    #: Who sent the request being handled, when its frames say (:mod:`cuctxd.daemon.intake.peers`); set by the front.
    request_peer: str | None = None
