"""What the front thread knows: sessions, the device list, the backend, limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from daemon.config import DaemonConfig
from daemon.sessions import SessionRegistry
from protos.records import DeviceInfo


@dataclass
class FrontState:
    """Owned by the front thread; device workers never see it."""

    config: DaemonConfig
    backend: str
    devices: list[DeviceInfo]
    sessions: SessionRegistry = field(default_factory=SessionRegistry)
    started_at: float = field(default_factory=time.time)
    requests_served: int = 0
