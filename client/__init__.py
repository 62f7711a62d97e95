"""The cuctxd client library: ``from client import Client, CudaError``."""

from client.client import Client
from client.objects import Buffer, Context
from client.pipeline import Pipeline
from client.sharing import OpenedShare
from client.streams import Event, Stream
from protos.errors import (
    BadArgument,
    BadOp,
    BadRequest,
    ConnectionLost,
    CuctxError,
    CudaError,
    DaemonError,
    DaemonTimeout,
    NameExists,
    NotFound,
    NotOwner,
    NotShareable,
    OutOfRange,
    SessionExpired,
    TooLarge,
    UnknownHandle,
    UnknownSession,
    VersionMismatch,
)
from protos.records import DeviceInfo, ShareDescriptor

__all__ = [
    "BadArgument", "BadOp", "BadRequest", "Buffer", "Client", "ConnectionLost", "Context", "CuctxError",
    "CudaError", "DaemonError", "DaemonTimeout", "DeviceInfo", "Event", "NameExists", "NotFound", "NotOwner",
    "NotShareable", "OpenedShare", "OutOfRange", "Pipeline", "SessionExpired", "ShareDescriptor", "Stream",
    "TooLarge",
    "UnknownHandle", "UnknownSession", "VersionMismatch",
]
