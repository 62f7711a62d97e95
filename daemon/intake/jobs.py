"""A decoded, validated request on its way to the device worker that runs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from cuctxd.daemon.registry.sessions import DeviceBacklog, SessionRef
from cuctxd.protos.schema import OpSpec

#: The op's argument class (``ops.Fill``, ...): a handler declares ``job: Job[ops.Fill]`` and reads typed ``args``.
ArgsT = TypeVar("ArgsT")


class Job(NamedTuple, Generic[ArgsT]):
    """Everything a device handler needs; immutable, so handing it across threads is safe.

    ``args``: the request's arguments as decoded into the op's class (:func:`~cuctxd.protos.schema.decode_args`).
    ``device`` is resolved on receipt (the op's ``device`` argument, else the
    session's current device). ``payload`` holds the request's raw frames.
    ``lane``: the device whose own ROUTER received the request and must send the
    reply (:mod:`cuctxd.daemon.worker.lane`); None when it came through the front.
    ``received``: ``time.perf_counter()`` on arrival, for the request's latency.
    ``backlog``: the session's :class:`DeviceBacklog` on ``device`` (queue and reply limits).
    ``shm``: the session's shm lane (:mod:`cuctxd.daemon.device.shm_lanes`) the request came through and
    the reply goes to, instead of ``lane``'s ROUTER.
    """

    identity: bytes
    request_id: int
    spec: OpSpec
    args: ArgsT
    session: SessionRef
    device: int
    payload: Sequence[Any] = ()
    lane: int | None = None
    received: float = 0.0
    backlog: DeviceBacklog | None = None
    shm: Any = None


def payload_bytes(job: Job) -> int:
    """Bytes of the request's payload frames (what ``max_queued_bytes`` counts)."""
    return sum(len(frame) for frame in job.payload) if job.payload else 0
