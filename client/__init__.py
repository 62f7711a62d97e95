"""The cuctxd client library: ``from client import Client, CudaError`` (or ``AsyncClient`` for asyncio)."""

from cuctxd.client.api.async_client import AsyncClient
from cuctxd.client.api.client import Client
from cuctxd.client.api.objects import AsyncBuffer, AsyncContext, Buffer, Context
from cuctxd.client.api.pipeline import AsyncPipeline, Pipeline
from cuctxd.client.api.sharing import AsyncOpenedShare, OpenedShare
from cuctxd.client.api.streams import AsyncEvent, AsyncStream, Event, Stream
from cuctxd.client.data_plane.host_buffers import AsyncHostBuffer, HostBuffer
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import TensorSet, open_tensors
from cuctxd.client.tensors.torch_weights import LoadedState, load_state_dict, publish_state_dict
from cuctxd.client.tensors.versions import publish_version, wait_version
from cuctxd.protos.errors import (
    BadArgument,
    BadOp,
    BadRequest,
    ConnectionLost,
    CuctxError,
    CudaError,
    DaemonError,
    DaemonTimeout,
    DigestMismatch,
    LimitExceeded,
    NameExists,
    NoAccess,
    NoDaemon,
    NotFound,
    NotOwner,
    NotParked,
    NotShareable,
    OutOfRange,
    Revoked,
    SessionClosed,
    SessionExpired,
    SessionLost,
    TimedOut,
    TooLarge,
    UnknownHandle,
    UnknownSession,
    VersionMismatch,
    WrongBackend,
)
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

__all__ = [
    "AsyncBuffer", "AsyncClient", "AsyncContext", "AsyncEvent", "AsyncHostBuffer", "AsyncOpenedShare", "AsyncPipeline",
    "AsyncStream", "BadArgument", "BadOp", "BadRequest", "Buffer", "Client", "ConnectionLost", "Context", "CuctxError",
    "CudaError", "DaemonError", "DaemonTimeout", "DeviceInfo", "DigestMismatch", "Event", "HostBuffer", "LimitExceeded",
    "LoadedState", "NameExists", "NoAccess", "NoDaemon", "NotFound", "NotOwner", "NotParked", "NotShareable",
    "OpenedShare", "OutOfRange", "Pipeline", "Revoked", "SessionClosed", "SessionExpired", "SessionLost",
    "ShareDescriptor", "Stream", "TensorSet", "TimedOut", "TooLarge", "UnknownHandle", "UnknownSession",
    "VersionMismatch", "WrongBackend", "load_state_dict", "open_tensors", "publish_state_dict", "publish_tensors",
    "publish_version", "wait_version",
]
