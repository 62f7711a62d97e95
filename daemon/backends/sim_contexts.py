"""The sim's contexts, devices and per-thread context stacks: plain records the :class:`SimDriver` keeps.

Compared by identity, like the driver's handles; only the sim driver (under its
locks, or on the calling thread for a thread's own stack) changes them.
"""

from __future__ import annotations

import threading
import uuid

from cuctxd.daemon.backends.sim_streams import StreamSet
from cuctxd.protos.records import DeviceInfo


class SimContext:
    """A simulated ``CUcontext``: the opaque :data:`Ctx` the sim backend hands out.

    Compared by identity, like the driver's handles. ``allocations`` holds the base
    addresses of the memory allocated in it, freed when it is destroyed, as are its
    streams and events (``stream_set``).
    """

    __slots__ = ("alive", "allocations", "context_id", "device", "flags", "is_primary", "stream_set")

    def __init__(self, device: int, flags: int, is_primary: bool, context_id: int, alive: bool) -> None:
        self.device = device
        self.flags = flags
        self.is_primary = is_primary
        self.context_id = context_id
        self.alive = alive
        self.allocations: set[int] = set()
        self.stream_set = StreamSet()

    def __repr__(self) -> str:
        kind = "primary" if self.is_primary else "created"
        state = "" if self.alive else ", destroyed"
        return f"<SimContext {self.context_id} device {self.device}, {kind}{state}>"


class SimDevice:
    """One simulated GPU: its description and primary context (its memory is in :class:`DeviceMemory`)."""

    __slots__ = ("info", "primary", "primary_refcount")

    def __init__(self, ordinal: int, capacity: int) -> None:
        self.primary = SimContext(ordinal, 0, is_primary=True, context_id=0, alive=False)
        self.primary_refcount = 0
        name = uuid.uuid5(uuid.NAMESPACE_URL, f"cuctxd-sim://device/{ordinal}")
        self.info = DeviceInfo(
            index=ordinal,
            name="cuctxd simulated GPU",
            uuid=f"GPU-{name}",
            pci_bus_id=f"0000:{ordinal + 1:02x}:00.0",
            compute_capability=(9, 0),
            total_memory=capacity,
            multiprocessor_count=132,
        )


class ThreadStacks(threading.local):
    """The calling host thread's context stack; the top is the current context."""

    def __init__(self) -> None:
        self.stack: list[SimContext] = []
