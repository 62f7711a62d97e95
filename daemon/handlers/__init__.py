"""Request handlers, one function per op, grouped by what they touch."""

from cuctxd.daemon.handlers import (
    context_ops,
    host_ops,
    memory_ops,
    session_ops,
    sharing_ops,
    stream_ops,
    system_ops,
)
from cuctxd.daemon.handlers.registry import DEVICE_HANDLERS, FRONT_HANDLERS

__all__ = [
    "DEVICE_HANDLERS", "FRONT_HANDLERS", "context_ops", "host_ops", "memory_ops", "session_ops", "sharing_ops",
    "stream_ops", "system_ops",
]
