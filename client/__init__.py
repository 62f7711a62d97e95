"""The cuctxd client library: ``from client import Client, CudaError`` (or ``AsyncClient`` for asyncio)."""

from client.async_client import AsyncClient
from client.client import Client
from client.objects import AsyncBuffer, AsyncContext, Buffer, Context
from client.pipeline import AsyncPipeline, Pipeline
from client.sharing import AsyncOpenedShare, OpenedShare
from client.streams import AsyncEvent, AsyncStream, Event, Stream
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
    "AsyncBuffer", "AsyncClient", "AsyncContext", "AsyncEvent", "AsyncOpenedShare", "AsyncPipeline",
    "AsyncStream", "BadArgument", "BadOp", "BadRequest", "Buffer", "Client", "ConnectionLost", "Context",
    "CuctxError", "CudaError", "DaemonError", "DaemonTimeout", "DeviceInfo", "Event", "NameExists", "NotFound",
    "NotOwner", "NotShareable", "OpenedShare", "OutOfRange", "Pipeline", "SessionExpired", "ShareDescriptor",
    "Stream", "TooLarge",
    "UnknownHandle", "UnknownSession", "VersionMismatch",
]
