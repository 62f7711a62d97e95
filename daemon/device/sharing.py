"""Sharing on one device: exporting buffers, holds by other sessions, deferred free.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`; the lifetime rule is in
:mod:`cuctxd.daemon.registry.shares`, whose daemon-wide index (lock-protected,
read by the front) this keeps up to date.

What a session keeps alive, its quota pays for: the shares it holds open count
against ``session_quota`` (:meth:`Sharing.charges`), at what their memory takes of the
device (:attr:`Share.footprint`), unless they are of its own live buffers, which it
already pays for as allocations. An owner may ``revoke`` a
share: its names go, new opens are refused, every holder's hold is dropped and its
next ``open_shared``/``close_shared`` of it answers ``CUCTXD_ERROR_REVOKED``.

Memory that was shared is set to zero before it is freed (:meth:`Sharing.settle`): the
next allocation that gets those bytes, of whichever tenant, never reads what was shared. Not at the
daemon's stop (:meth:`Sharing.stop`): from then on the daemon hands no memory to anyone, and processes
may still map every share (the daemon knows only of sessions' holds), so no share is scrubbed or freed
any more; each goes with the daemon's process, as at a SIGKILL, and the driver keeps it for whoever maps it.

What a session leaves behind, its user pays for: a published share kept alive by its names alone
(owner gone, nobody holding it) counts against its owner's uid on this device
(``max_orphaned_bytes_per_uid``; peers whose uid the kernel does not tell, tcp://, are one uid,
None). ``publish`` is refused while the uid's orphans and the buffer together would pass it; a
session whose end leaves more frees the uid's oldest orphans (:meth:`Sharing.owner_left`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Protocol

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.contexts import Contexts
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import Buffer, DeviceLimits, SessionContext, SessionOnDevice, Share, check_limit
from cuctxd.daemon.device.spares import Spares
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.errors import CuctxError, LimitExceeded, NameExists, NotFound, NotOwner, NotShareable, Revoked
from cuctxd.protos.host import host_identity
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

log = logging.getLogger(__name__)


class ParkingHooks(Protocol):
    """What sharing tells the device's parking (:class:`cuctxd.daemon.device.parking.DeviceParking`)."""

    def sync(self, share: Share) -> None:
        """``share`` changed (names, holders, freed): park, update or unpark it."""

    def keeps(self, share: Share) -> bool:
        """Whether ``share`` is parked: its fd in the service manager's store keeps its memory past the daemon."""


class Sharing:
    """Export, open, close and settle the device's shares."""

    def __init__(self, driver: Driver, info: DeviceInfo, current: CurrentContext, contexts: Contexts,
                 registry: ShareRegistry, limits: DeviceLimits, sessions: Mapping[str, SessionOnDevice]) -> None:
        """``sessions`` is the :class:`DeviceState`'s own table, read to find a share's holders."""
        self.driver = driver
        self.device = contexts.device
        self.info = info
        self.current = current
        self.contexts = contexts
        self.registry = registry
        self.limits = limits
        self.sessions = sessions
        #: Every live share made on this device, by share id.
        self.shares: dict[str, Share] = {}
        #: Published shares kept alive by their names alone (owner gone, nobody holds them), oldest first.
        self.orphaned: dict[str, Share] = {}
        #: Their bytes by owner uid (None: unknown, tcp://), what ``max_orphaned_bytes_per_uid`` counts.
        self.orphaned_bytes: defaultdict[int | None, int] = defaultdict(int)
        #: ``max_orphaned_bytes_per_uid`` in effect here (0 in the configuration: the device's memory).
        self.orphan_bytes_limit = limits.max_orphaned_bytes_per_uid or info.total_memory
        #: Told of every change to a share, where persistent shares are parked (set by DeviceState).
        self.parking: ParkingHooks | None = None
        #: The daemon is stopping (:meth:`stop`): no share is scrubbed or freed from now on.
        self.stopping = False
        #: Shares some session held open when the stop began.
        self.held_at_stop = 0
        #: The allocations of freed versions kept for their name's next version.
        self.spares = Spares(self.device, current, registry, self._release_context, self._charge_orphaned)

    def _check_share_room(self, state: SessionOnDevice) -> None:
        check_limit("max_shares_per_session", self.limits.max_shares_per_session, state.share_count(),
                    "shares (exported, held open, or revoked and not closed yet)", self.device)

    @staticmethod
    def charges(state: SessionOnDevice, share: Share) -> bool:
        """Whether ``state``'s quota pays for holding ``share``: yes, unless it is the session's own
        live buffer (already counted as allocated)."""
        return not (share.owner_present and share.owner.token == state.ref.token)

    def export(self, state: SessionOnDevice, buffer: Buffer) -> Share:
        """Make a buffer shareable (once); the share keeps its context alive past the session."""
        if buffer.share is not None:
            if buffer.share.revoked:
                raise Revoked("this buffer's share was revoked; it cannot be shared again")
            return buffer.share
        self._check_share_room(state)
        if not buffer.kind.exportable:
            raise NotShareable(
                "this buffer comes from a private pool, which is never exported (other sessions' memory "
                "lives there); allocate it with shareable=True to share it"
            )
        self.current.activate(buffer.context)
        how = buffer.kind.export(buffer.context, buffer.ptr)
        if buffer.context.is_primary:
            self.contexts.retain_primary()  # the share's own reference
        if not buffer.buffer_id:
            buffer.buffer_id = secrets.token_hex(16)
        descriptor = ShareDescriptor(
            share_id=secrets.token_hex(16),
            device=self.device,
            device_uuid=self.info.uuid,
            size=buffer.size,
            backend=self.driver.name,
            host=host_identity(),
            buffer_id=buffer.buffer_id,
            **how,
        )
        share = Share(descriptor, buffer.ptr, buffer.context, state.ref, buffer.kind)
        buffer.share = share
        state.exports += 1
        buffer.context.shares.add(share.share_id)
        self.shares[share.share_id] = share
        self.registry.add(share)
        return share

    def check_orphan_room(self, state: SessionOnDevice, buffer: Buffer) -> None:
        """Before ``buffer`` gets its first name: :class:`LimitExceeded` naming ``max_orphaned_bytes_per_uid``
        when the uid's orphans here and this buffer, once left behind too, would pass the limit."""
        if buffer.share is not None and buffer.share.names:
            return  # already published: its bytes were checked then
        uid = state.ref.uid
        limit = self.orphan_bytes_limit
        footprint = buffer.footprint
        while self.orphaned_bytes.get(uid, 0) + footprint > limit and self.spares.release_of_uid(uid):
            pass  # a spare is only kept for a next version: it never costs a publish its room
        orphaned = self.orphaned_bytes.get(uid, 0)
        if orphaned + footprint > limit:
            raise LimitExceeded(
                f"max_orphaned_bytes_per_uid: {_uid_text(uid)} already leaves {orphaned} bytes on device "
                f"{self.device} in published buffers whose owner is gone; publishing {footprint} more would pass "
                f"the limit of {limit} once its session ends too; unpublish some of them first")

    def open(self, state: SessionOnDevice, share_id: str) -> Share:
        """Hold a share open for ``state``; a first hold counts against its shares limit and its quota."""
        share = self.shares.get(share_id)
        if share_id in state.revoked or (share is not None and share.revoked):
            state.revoked.discard(share_id)
            raise Revoked("its owner revoked this shared buffer; close any mapping of it you still have")
        if share is None or not share.keeps_alive():
            raise NotFound("no such shared buffer on this device (never exported, or already freed)")
        if share_id not in state.holds:
            self._check_share_room(state)
            state.check_room(self.limits.max_objects_per_session, "share hold")
            if self.charges(state, share):
                state.check_quota(self.limits.session_quota, share.footprint, "hold open a share of")
                state.bytes_held += share.footprint
        if not share.owner_present:
            share.opened_since_orphaned = True
            share.retained = False  # held again: its holders keep it from now on
            self._not_orphaned(share)
        state.holds[share_id] = state.holds.get(share_id, 0) + 1
        share.holders[state.ref.token] = share.holders.get(state.ref.token, 0) + 1
        self.registry.update(share)
        return share

    def close(self, state: SessionOnDevice, share_id: str) -> None:
        if share_id in state.revoked:
            state.revoked.discard(share_id)
            raise Revoked("its owner revoked this shared buffer and your hold was dropped then; "
                          "close your mapping of it")
        if share_id not in state.holds:
            raise NotFound("this session does not hold that shared buffer open")
        self.drop_hold(state, share_id, everything=False)

    def revoke(self, state: SessionOnDevice, share_id: str) -> Share:
        """The owner withdraws a share: names go, every hold is dropped (each holder told on its next
        use), and the memory is freed once the owner lets the buffer go (now, if it already has)."""
        share = self.shares.get(share_id)
        if share is None:
            raise NotFound("no such shared buffer on this device (never exported, or already freed)")
        if share.owner.token != state.ref.token:
            raise NotOwner("only the session that exported a shared buffer may revoke it")
        share.revoked = True
        self.registry.drop_names(share)
        for token in list(share.holders):
            holder = self.sessions.get(token)
            if holder is not None and share_id in holder.holds:
                del holder.holds[share_id]
                if self.charges(holder, share):
                    holder.bytes_held -= share.footprint
                holder.revoked.add(share_id)
        share.holders.clear()
        self.settle(share)
        return share

    def owner_left(self, state: SessionOnDevice, share: Share, *, unpublish: bool) -> None:
        """The buffer's owner (``state``) let go (freed it, or its session ended): the share lives on
        while held, or published (unless ``unpublish``, as for an explicit free). A hold the owner
        keeps on it now counts against the owner's quota."""
        state.exports -= 1
        if share.share_id in state.holds:
            state.bytes_held += share.footprint
        share.owner_present = False
        share.opened_since_orphaned = bool(share.holders)
        if unpublish:
            self.registry.drop_names(share)
        else:
            self.registry.unstage(share)  # a copy staged for a publish that will not come now
        self.settle(share)  # kept by its names alone from now on: counted as an orphan there

    def _orphan(self, share: Share) -> None:
        """``share`` is kept alive by its names alone now: counted (daemon-wide and against its owner's
        uid) and its ``orphan_ttl`` starts, then the oldest orphans go beyond either limit. Once: a persistent
        share's settle may have counted it already (counting it twice passed ``max_orphaned_bytes_per_uid`` at
        half the bytes)."""
        if share.share_id in self.orphaned:
            return
        share.orphaned_at = time.monotonic()
        self.orphaned[share.share_id] = share
        self._charge_orphaned(share.owner.uid, share.footprint)
        self.registry.count_orphan(share.share_id, True)
        self._evict_orphans(share.owner.uid)

    def _evict_orphans(self, uid: int | None) -> None:
        """Above ``max_orphaned_shares`` (daemon-wide), free this device's oldest name-only orphans; above
        ``max_orphaned_bytes_per_uid``, the oldest of ``uid``'s."""
        limit = self.limits.max_orphaned_shares
        while limit and self.orphaned and self.registry.orphan_count() > limit:
            self._evict(next(iter(self.orphaned.values())), "max_orphaned_shares", limit)
        limit = self.orphan_bytes_limit
        while self.orphaned_bytes.get(uid, 0) > limit:
            if self.spares.release_of_uid(uid):
                continue
            oldest = next(share for share in self.orphaned.values() if share.owner.uid == uid)
            self._evict(oldest, "max_orphaned_bytes_per_uid", limit)

    def _evict(self, share: Share, limit_name: str, limit: int) -> None:
        log.warning("device %d: %s (%d) reached: freeing the oldest orphaned share %s… (%d bytes, names %s, "
                    "owner session %d gone, %s)", self.device, limit_name, limit, share.share_id[:8],
                    share.descriptor.size, sorted(share.names), share.owner.public_id, _uid_text(share.owner.uid))
        self.registry.drop_names(share)
        self.settle(share)

    def _not_orphaned(self, share: Share) -> None:
        if self.orphaned.pop(share.share_id, None) is not None:
            self._charge_orphaned(share.owner.uid, -share.footprint)
            self.registry.count_orphan(share.share_id, False)

    def _charge_orphaned(self, uid: int | None, size: int) -> None:
        """``size`` bytes more (fewer, negative) left behind by ``uid`` here: its orphans' and spares'."""
        self.orphaned_bytes[uid] += size
        if not self.orphaned_bytes[uid]:
            del self.orphaned_bytes[uid]

    def forget_name(self, name: str, share_id: str) -> None:
        """After the front unpublished ``name``: drop it here and free the share if that was all."""
        share = self.shares.get(share_id)
        if share is not None:
            share.names.discard(name)
            self.settle(share)

    def expire_orphans(self, now: float, ttl: float) -> None:
        """Unpublish (and so free) the buffers kept by their names alone for ``ttl`` seconds: owner gone,
        nobody holding them since (oldest first: stops at the first younger one); not persistent ones."""
        self.spares.release_stale()  # those of names whose last version went on another device
        for share in list(self.orphaned.values()):
            if share.persistent and not share.retained:
                continue  # waits for its unpublish (or eviction beyond max_orphaned_shares)
            if share.orphaned_at is None or now - share.orphaned_at <= ttl:
                break
            share.retained = False
            if not share.persistent:  # a retained older version's own names (current ones) stay
                self.registry.drop_names(share)
            self.settle(share)

    def adopt(self, share: Share, namings: Iterable[tuple[str, Naming]],
              versions: Mapping[str, tuple[int, bool]] | None = None) -> list[str]:
        """A share re-adopted at start (its owner gone, persistent): indexed and named again, kept by its names;
        the names restored (one that cannot be is logged and left out; without any the share is freed).
        ``versions``: the (number, current) of each name it is a version of; an older version is kept as
        :attr:`Share.retained` until a session holds it or ``orphan_ttl`` passes."""
        share.context.shares.add(share.share_id)
        self.shares[share.share_id] = share
        self.registry.add(share)
        restored = []
        for name, naming in namings:
            try:
                if versions and name in versions:
                    number, current = versions[name]
                    self.registry.restore_version(name, share, naming, number, current)
                    share.retained = share.retained or not current
                else:
                    try:
                        self.registry.publish(name, share, naming)
                    except NameExists:  # another device adopted the name's first copy: this is its copy here
                        self.registry.publish(name, share, naming, copy=True)
                restored.append(name)
            except CuctxError as exc:
                log.warning("device %d: the parked name %r is not restored: %s", self.device, name, exc)
        self.settle(share)
        return restored

    def stop(self) -> None:
        """The daemon is stopping (the worker's first step at its shutdown, whatever ended its loop): from now on
        no share is scrubbed or freed, whatever lets go of it. Every share may still be mapped by a process (a
        holder's, or one whose session ended but kept its mapping) and a write would change what it computes;
        the daemon hands no memory to anyone any more, so there is no next tenant to protect. The memory goes with
        the daemon's process, and the driver keeps it while any process maps it (a parked share's fd keeps it
        in the service manager's store too)."""
        self.stopping = True
        self.held_at_stop = sum(1 for share in self.shares.values() if share.holders)
        self.spares.release_all()  # mapped by no process through the daemon; one that keeps a mapping keeps it

    def left_at_stop(self) -> str | None:
        """After every session closed at the stop: what the log says of the shares left to the processes that
        map them (None when there are none)."""
        if not self.shares:
            return None
        parked = sum(1 for share in self.shares.values() if self.parking is not None and self.parking.keeps(share))
        size = sum(share.descriptor.size for share in self.shares.values())
        return (f"device {self.device}: {len(self.shares)} shared buffer(s), {size} bytes, left unscrubbed to the "
                f"processes that map them ({self.held_at_stop} held open by a session when the stop began, {parked} "
                "parked with the service manager); the driver frees each once no process maps it")

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
            if self.charges(state, share):
                state.bytes_held -= share.footprint
        self.settle(share)

    def settle(self, share: Share) -> None:
        """Scrub and free a share's memory once nothing keeps it alive (deferred free); never once the daemon is
        stopping (:meth:`stop`)."""
        if share.keeps_alive():
            self.registry.update(share)
            if not share.owner_present and not share.holders and not share.checks and not self.stopping:
                self._orphan(share)  # kept by its names alone (again): counted (not the stop's own doing)
            if self.parking is not None and share.share_id in self.shares:
                self.parking.sync(share)
            return
        if self.stopping:
            return  # left to the processes that map it (stop)
        versioned = [name for name, _, _, _ in self.registry.versions_of(share)]
        spare = bool(versioned) and self.spares.keep(share, versioned)  # its name's next version goes there
        if not spare:
            self.current.activate(share.context)
            share.kind.scrub(share.ptr, share.descriptor.size)  # its next user must not read what was shared
            share.kind.free(share.ptr)
        del self.shares[share.share_id]
        self._not_orphaned(share)
        self.registry.remove(share)
        share.names.clear()
        if not spare:
            self._release_context(share.context, share.share_id)
            for name in versioned:  # its name's last version: the spare goes with it
                if not self.registry.buffers(name):
                    self.spares.release(name)
        if self.parking is not None:
            self.parking.sync(share)

    def _release_context(self, context: SessionContext, share_id: str) -> None:
        """The reference a share (or the spare it left) held on its context goes: the primary's is released, a
        created context left by its session ends with its last share."""
        context.shares.discard(share_id)
        if context.is_primary:
            self.contexts.release_primary(context)
        elif not context.shares and self.contexts.orphans.pop(context.context_id, None) is not None:
            self.contexts.end(context)


def _uid_text(uid: int | None) -> str:
    return "the peers whose uid is unknown (tcp://)" if uid is None else f"uid {uid}"
