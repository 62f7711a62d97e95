"""The cuctxd client library: ``from client import Client, CudaError``."""

from client.client import Client
from client.objects import Buffer, Context
from protos.errors import (
    BadArgument,
    BadOp,
    BadRequest,
    ConnectionLost,
    CuctxError,
    CudaError,
    DaemonError,
    DaemonTimeout,
    OutOfRange,
    SessionExpired,
    TooLarge,
    UnknownHandle,
    UnknownSession,
    VersionMismatch,
)
from protos.records import DeviceInfo

__all__ = [
    "BadArgument", "BadOp", "BadRequest", "Buffer", "Client", "ConnectionLost", "Context", "CuctxError",
    "CudaError", "DaemonError", "DaemonTimeout", "DeviceInfo", "OutOfRange", "SessionExpired", "TooLarge",
    "UnknownHandle", "UnknownSession", "VersionMismatch",
]
