"""Which host a process runs on, so a share descriptor can tell it is being opened elsewhere."""

from __future__ import annotations

import socket
from functools import cache
from pathlib import Path


@cache
def host_identity() -> str:
    """``hostname/boot-id``: equal for two processes only on the same running machine."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
