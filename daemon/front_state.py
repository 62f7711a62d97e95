"""What the front thread knows: sessions, the device list, the backend, limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from daemon.config import DaemonConfig
from daemon.sessions import SessionRegistry
from daemon.sharing import ShareRegistry
from protos.records import DeviceInfo


@dataclass
class FrontState:
    """Owned by the front thread; device workers never see it."""

    config: DaemonConfig
    backend: str
    devices: list[DeviceInfo]
    shares: ShareRegistry
    sessions: SessionRegistry = field(default_factory=SessionRegistry)
    sessions_reaped: int = 0
    started_at: float = field(default_factory=time.time)
    requests_served: int = 0
    #: Set by the daemon when a shutdown starts: every new request is answered ShuttingDown.
    draining: bool = False
    #: Who sent the request being handled, when its frames say (:mod:`daemon.peers`); set by the front.
    request_peer: str | None = None
