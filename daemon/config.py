"""The daemon's effective configuration, and parsing of human sizes like ``8GiB``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from protos.limits import DEFAULT_MAX_PAYLOAD_BYTES

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
#: Seconds a session lives without a request or heartbeat before it is reaped.
DEFAULT_LEASE_TTL = 5.0

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes. Raises ValueError on garbage."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon needs to start; built by the CLI, used read-only afterwards."""

    endpoints: tuple[str, ...]
    backend: str = "auto"
    sim_devices: int = 2
    sim_memory: int = 1 << 30
    max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES
    log_level: str = "INFO"
    lease_ttl: float = DEFAULT_LEASE_TTL
    session_quota: int = 0
    device_reserve: int = 0
