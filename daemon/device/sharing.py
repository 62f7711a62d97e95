"""Sharing on one device: exporting buffers, holds by other sessions, deferred free.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`; the lifetime rule is in
:mod:`cuctxd.daemon.registry.shares`, whose daemon-wide index (lock-protected,
read by the front) this keeps up to date.
"""

from __future__ import annotations

import secrets
import time

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.contexts import Contexts
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import Buffer, SessionOnDevice, Share
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.errors import NotFound, NotShareable
from cuctxd.protos.host import host_identity
from cuctxd.protos.records import DeviceInfo, ShareDescriptor


class Sharing:
    """Export, open, close and settle the device's shares."""

    def __init__(self, driver: Driver, info: DeviceInfo, current: CurrentContext, contexts: Contexts,
                 registry: ShareRegistry, object_limit: int) -> None:
        self.driver = driver
        self.device = contexts.device
        self.info = info
        self.current = current
        self.contexts = contexts
        self.registry = registry
        self.object_limit = object_limit
        #: Every live share made on this device, by share id.
        self.shares: dict[str, Share] = {}

    def export(self, state: SessionOnDevice, buffer: Buffer) -> Share:
        """Make a buffer shareable (once); the share keeps its context alive past the session."""
        if buffer.share is not None:
            return buffer.share
        if not buffer.shareable:
            raise NotShareable(
                "this buffer comes from the device's stream-ordered pool, which cannot be exported; "
                "allocate it with shareable=True (cuMemAlloc) to share it"
            )
        self.current.activate(buffer.context)
        ipc_handle = self.driver.ipc_get_mem_handle(buffer.ptr)
        if buffer.context.is_primary:
            self.contexts.retain_primary()  # the share's own reference
        descriptor = ShareDescriptor(
            share_id=secrets.token_hex(16),
            device=self.device,
            device_uuid=self.info.uuid,
            size=buffer.size,
            backend=self.driver.name,
            ipc_handle=ipc_handle,
            host=host_identity(),
        )
        share = Share(descriptor, buffer.ptr, buffer.context, state.ref)
        buffer.share = share
        buffer.context.shares.add(share.share_id)
        self.shares[share.share_id] = share
        self.registry.add(share)
        return share

    def open(self, state: SessionOnDevice, share_id: str) -> Share:
        share = self.shares.get(share_id)
        if share is None or not share.keeps_alive():
            raise NotFound("no such shared buffer on this device (never exported, or already freed)")
        if share_id not in state.holds:
            state.check_room(self.object_limit, "share hold")
        if not share.owner_present:
            share.opened_since_orphaned = True
        state.holds[share_id] = state.holds.get(share_id, 0) + 1
        share.holders[state.ref.token] = share.holders.get(state.ref.token, 0) + 1
        self.registry.update(share)
        return share

    def close(self, state: SessionOnDevice, share_id: str) -> None:
        if share_id not in state.holds:
            raise NotFound("this session does not hold that shared buffer open")
        self.drop_hold(state, share_id, everything=False)

    def owner_left(self, share: Share, *, unpublish: bool) -> None:
        """The buffer's owner let go (freed it, or its session ended): the share lives on while held,
        or published (unless ``unpublish``, as for an explicit free)."""
        share.owner_present = False
        share.orphaned_at = time.monotonic()
        share.opened_since_orphaned = bool(share.holders)
        if unpublish:
            self.registry.drop_names(share)
        self.settle(share)

    def forget_name(self, name: str, share_id: str) -> None:
        """After the front unpublished ``name``: drop it here and free the share if that was all."""
        share = self.shares.get(share_id)
        if share is not None:
            share.names.discard(name)
            self.settle(share)

    def expire_orphans(self, now: float, ttl: float) -> None:
        """Free published buffers whose owner left ``ttl`` seconds ago and nobody has open."""
        for share in list(self.shares.values()):
            if (share.orphaned_at is not None and not share.holders and share.names
                    and now - share.orphaned_at > ttl):
                self.registry.drop_names(share)
                self.settle(share)

    def drop_all(self) -> None:
        """At shutdown, after every session closed: free what published names and orphans kept."""
        for share in list(self.shares.values()):
            self.registry.drop_names(share)
            share.owner_present = False
            share.holders.clear()
            self.settle(share)

    def drop_hold(self, state: SessionOnDevice, share_id: str, *, everything: bool) -> None:
        count = 0 if everything else state.holds[share_id] - 1
        if count:
            state.holds[share_id] = count
        else:
            state.holds.pop(share_id, None)
        share = self.shares.get(share_id)
        if share is None:
            return
        if count:
            share.holders[state.ref.token] = count
        else:
            share.holders.pop(state.ref.token, None)
        self.settle(share)

    def settle(self, share: Share) -> None:
        """Free a share's memory once nothing keeps it alive (deferred free)."""
        if share.keeps_alive():
            self.registry.update(share)
            return
        context = share.context
        self.current.activate(context)
        self.driver.mem_free(share.ptr)
        del self.shares[share.share_id]
        context.shares.discard(share.share_id)
        self.registry.remove(share)
        share.names.clear()
        if context.is_primary:
            self.contexts.release_primary(context)
        elif not context.shares and self.contexts.orphans.pop(context.context_id, None) is not None:
            self.contexts.end(context)
