"""A plain share record for the ShareRegistry's unit tests: what the registry reads of a device's share
(:class:`cuctxd.daemon.registry.shares.ShareRecord`), without a device."""

from __future__ import annotations

from dataclasses import dataclass, field

from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.records import ShareDescriptor


@dataclass
class PlainShare:
    """A 4 KiB sim share of ``owner``'s on ``device`` (0 unless given; its uuid ``u``, or ``u<device>``)."""

    share_id: str
    owner: SessionRef
    descriptor: ShareDescriptor = field(init=False)
    owner_present: bool = True
    holders: dict[str, int] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    device: int = 0

    def __post_init__(self) -> None:
        self.descriptor = ShareDescriptor(share_id=self.share_id, device=self.device,
                                          device_uuid=f"u{self.device or ''}", size=4096,
                                          backend="sim", ipc_handle=b"", host="h")
