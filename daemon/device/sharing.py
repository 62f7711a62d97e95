# mypy: disable-error-code="misc"
"""Sharing on one device: exporting buffers, holds by other sessions, deferred free.

These are :class:`~cuctxd.daemon.device.state.DeviceState` methods (mixed in), run on
the device's worker thread; the lifetime rule is in :mod:`cuctxd.daemon.registry.shares`.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from cuctxd.daemon.registry.shares import Share
from cuctxd.protos.errors import NotFound, NotShareable
from cuctxd.protos.host import host_identity
from cuctxd.protos.records import ShareDescriptor

if TYPE_CHECKING:
    from cuctxd.daemon.device.state import DeviceState, SessionOnDevice


class SharingMixin:
    """Export, open, close and settle shares of a :class:`DeviceState`."""

    def export(self: DeviceState, state: SessionOnDevice, handle: int) -> Share:
        """Make a buffer shareable (once); the share keeps its context alive past the session."""
        buffer = self.buffer(state, handle)
        if buffer.share is not None:
            return buffer.share
        if not buffer.shareable:
            raise NotShareable(
                "this buffer comes from the device's stream-ordered pool, which cannot be exported; "
                "allocate it with shareable=True (cuMemAlloc) to share it"
            )
        self.activate(buffer.context)
        ipc_handle = self.driver.ipc_get_mem_handle(buffer.ptr)
        if buffer.context.is_primary:
            self.driver.primary_ctx_retain(self.device)  # the share's own reference
            self.primary_refs += 1
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

    def open_share(self: DeviceState, state: SessionOnDevice, share_id: str) -> Share:
        share = self.shares.get(share_id)
        if share is None or not share.keeps_alive():
            raise NotFound("no such shared buffer on this device (never exported, or already freed)")
        if share_id not in state.holds:
            self.check_object_limit(state, "share hold")
        if not share.owner_present:
            share.opened_since_orphaned = True
        state.holds[share_id] = state.holds.get(share_id, 0) + 1
        share.holders[state.ref.token] = share.holders.get(state.ref.token, 0) + 1
        self.registry.update(share)
        return share

    def close_share(self: DeviceState, state: SessionOnDevice, share_id: str) -> None:
        if share_id not in state.holds:
            raise NotFound("this session does not hold that shared buffer open")
        self._drop_hold(state, share_id, everything=False)

    def forget_name(self: DeviceState, name: str, share_id: str) -> None:
        """After the front unpublished ``name``: drop it here and free the share if that was all."""
        share = self.shares.get(share_id)
        if share is not None:
            share.names.discard(name)
            self._settle(share)

    def expire_orphans(self: DeviceState, now: float, ttl: float) -> None:
        """Free published buffers whose owner left ``ttl`` seconds ago and nobody has open."""
        for share in list(self.shares.values()):
            if (share.orphaned_at is not None and not share.holders and share.names
                    and now - share.orphaned_at > ttl):
                self.registry.drop_names(share)
                self._settle(share)

    def drop_all_shares(self: DeviceState) -> None:
        """At shutdown, after every session closed: free what published names and orphans kept."""
        for share in list(self.shares.values()):
            self.registry.drop_names(share)
            share.owner_present = False
            share.holders.clear()
            self._settle(share)

    def _drop_hold(self: DeviceState, state: SessionOnDevice, share_id: str, *, everything: bool) -> None:
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
        self._settle(share)

    def _settle(self: DeviceState, share: Share) -> None:
        """Free a share's memory once nothing keeps it alive (deferred free)."""
        if share.keeps_alive():
            self.registry.update(share)
            return
        context = share.context
        self.activate(context)
        self.driver.mem_free(share.ptr)
        del self.shares[share.share_id]
        context.shares.discard(share.share_id)
        self.registry.remove(share)
        share.names.clear()
        if context.is_primary:
            self._release_primary(context)
        elif not context.shares and self.orphans.pop(context.context_id, None) is not None:
            self.end_context(context)
