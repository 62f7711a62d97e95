"""One device's side of parking: persistent shares handed to the service manager's fd store, and adopted back.

Owned by the device's worker thread, as part of its
:class:`~cuctxd.daemon.device.state.DeviceState`; the daemon-wide
:class:`~cuctxd.daemon.registry.parking.ParkingLot` (lock-protected) keeps the store and the
parked records. A ``persistent`` publish parks its share (:meth:`DeviceParking.ready`, then
:meth:`DeviceParking.sync_published`), or fails with ``NotParked``; sharing tells this of every
later change (:meth:`DeviceParking.sync`): a share stays parked while it is persistent, named and
not revoked. Every change is sent to the store before the handler that made it returns, so its
reply follows the store's datagrams.

What keeps a share's memory alive outside the daemon is an fd: a pool of its own's
(``cuMemPoolExportToShareableHandle``; the sim's pool memfd), a VMM allocation's
(``cuMemExportToShareableHandle``; the sim's memfd) or, for a ``cuMemAlloc`` buffer, the
allocation's own (the sim's memfd; cuda has none: a persistent publish of one fails).
A new daemon re-adopts it from that fd (:meth:`DeviceParking.adopt`): it imports the pool and
the buffer (``cuMemPoolImportFromShareableHandle``, ``cuMemPoolImportPointer`` with the parked
export data), imports and maps the VMM allocation (``cuMemImportFromShareableHandle``,
``cuMemMap`` of its whole size) or maps the memory, checks its size, and restores its names with the publisher
gone, in the primary context; the memory counts against the device again, and the share is
freed as any other once it is unpublished.
"""

from __future__ import annotations

import logging
import os
import secrets

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.device.contexts import Contexts
from cuctxd.daemon.device.current import CurrentContext
from cuctxd.daemon.device.entries import MemoryKind, SessionContext, Share
from cuctxd.daemon.device.pools import LegacyMemory, OwnPoolMemory, Pools, VmmMemory, round_to_granularity
from cuctxd.daemon.device.sharing import Sharing
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.parked_records import ParkedName, ParkedShare
from cuctxd.daemon.registry.parking import ParkingLot
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.protos.errors import CuctxError, CudaError, NotParked
from cuctxd.protos.host import host_identity
from cuctxd.protos.layouts import stated_digest
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

log = logging.getLogger(__name__)


class NotAdopted(Exception):
    """A parked share this device cannot verify (the message says why)."""


class DeviceParking:
    """Park, update and unpark this device's persistent shares; adopt parked ones at start (worker thread)."""

    def __init__(self, driver: Driver, info: DeviceInfo, current: CurrentContext, contexts: Contexts, pools: Pools,
                 sharing: Sharing, registry: ShareRegistry, own_pool_memory: OwnPoolMemory,
                 legacy_memory: LegacyMemory, vmm_memory: VmmMemory) -> None:
        self.driver = driver
        self.device = contexts.device
        self.info = info
        self.current = current
        self.contexts = contexts
        self.pools = pools
        self.sharing = sharing
        self.registry = registry
        self.own_pool_memory = own_pool_memory
        self.legacy_memory = legacy_memory
        self.vmm_memory = vmm_memory

    @property
    def lot(self) -> ParkingLot | None:
        return self.registry.parking

    def keeps(self, share: Share) -> bool:
        lot = self.lot
        return lot is not None and lot.parked(share.share_id) is not None

    def ready(self, share: Share) -> int | None:
        """Before a ``persistent`` publish names ``share``: the fd that will park it (the caller's, for
        :meth:`sync_published`), or None where none is needed (no service manager, or parked already).
        :class:`NotParked` where it cannot be parked: the store or the owner's uid's share of it is full, or
        its memory has no fd."""
        lot = self.lot
        if lot is None or lot.parked(share.share_id) is not None:
            return None
        lot.check_room(share.owner.uid)
        return self._memory_fd(share)

    def sync(self, share: Share) -> None:
        """Update ``share``'s record, or unpark it, after a change (sharing calls this after each); parks nothing
        new (a publish does, :meth:`sync_published`). Never raises: a record the store refused is logged."""
        try:
            self._sync(share, None)
        except (CuctxError, OSError) as exc:
            log.warning("device %d: share %s…'s parked record is not up to date: %s", self.device,
                        share.share_id[:8], exc)

    def sync_published(self, share: Share, fd: int | None) -> None:
        """After a publish named ``share``: park it with ``fd`` (from :meth:`ready`; closed here), or update its
        record; returns once the store has been sent the change. :class:`NotParked` if the store refused it."""
        self._sync(share, fd)

    def _sync(self, share: Share, fd: int | None) -> None:
        try:
            lot = self.lot
            if lot is None:
                return
            parked = lot.parked(share.share_id)
            live = share.share_id in self.sharing.shares
            versions = self.registry.versions_of(share) if live else []
            if not (live and share.persistent and (share.names or versions) and not share.revoked):
                if parked is not None:
                    lot.unpark(share.share_id)
                return
            if parked is not None:
                lot.update(self._record(share, versions))
            elif fd is not None:
                lot.park(self._record(share, versions), fd)
        finally:
            if fd is not None:
                os.close(fd)

    def _record(self, share: Share, versions: list[tuple[str, int, Naming, bool]]) -> ParkedShare:
        descriptor = share.descriptor
        numbered = {name: (number, current) for name, number, _, current in versions}
        names = tuple(ParkedName(name, naming.manifest, naming.tensors, naming.read_only,
                                 *numbered.pop(name, (0, True)))
                      for name, naming in sorted(self.registry.namings(share).items()))
        names += tuple(ParkedName(name, naming.manifest, naming.tensors, naming.read_only, number, False)
                       for name, number, naming, current in versions if not current)
        owner = share.owner
        return ParkedShare(share.share_id, self.device, descriptor.device_uuid, descriptor.size, descriptor.backend,
                           descriptor.mechanism, descriptor.export_data if descriptor.mechanism == "pool" else b"",
                           names, {"session": owner.public_id, "client": owner.client, "pid": owner.pid,
                                   "uid": owner.uid})

    def _memory_fd(self, share: Share) -> int:
        """A new fd that keeps ``share``'s memory alive; :class:`NotParked` where there is none."""
        try:
            if share.ptr in self.pools.own:
                fd: int | None = self.pools.export_fd(share.ptr)
            elif share.kind is self.vmm_memory:
                fd = self.vmm_memory.export_fd(share.ptr, share.owner)
            else:
                self.current.activate(share.context)
                fd = self.driver.mem_export_fd(share.ptr)
        except CudaError as exc:
            raise NotParked(f"its memory's fd could not be exported: {exc}") from None
        if fd is None:
            raise NotParked(f"{self.driver.name} memory of this kind ({share.descriptor.size} bytes, cuMemAlloc + "
                            "cuIpc) has no fd to park; allocate it with shareable=True (a pool of its own or VMM "
                            "memory), or publish without persistent (a restart then forgets the name)")
        return fd

    # --- at start -------------------------------------------------------------------------

    def adopt(self, record: ParkedShare, fd: int) -> bool:
        """Re-import a parked share from ``fd`` (the caller's; kept stored) and restore its names; False (and a
        log line, and the fd dropped from the store) for one that cannot be verified."""
        lot = self.lot
        assert lot is not None, "adoption needs the parking lot"
        names = [n.name for n in record.names]
        try:
            share = self._import(record, fd)
        except (NotAdopted, CuctxError, OSError) as exc:
            log.warning("device %d: parked share %s… (names %s) not adopted: %s", self.device, record.share_id[:8],
                        names, exc)
            lot.forget(record.fdname, "its memory could not be adopted")
            return False
        adopted = ParkedShare(record.share_id, self.device, record.device_uuid, record.size, record.backend,
                              record.mechanism, record.export_data, record.names, record.publisher)
        lot.adopted(adopted, fd)
        restored = self.sharing.adopt(share, [(n.name, Naming(n.manifest, n.tensors, n.read_only,
                                                              stated_digest(n.manifest) if n.manifest else None))
                                              for n in record.names],
                                      {n.name: (n.version, n.current) for n in record.names if n.version})
        log.info("device %d: adopted parked share %s… (%d bytes, %s) as %s", self.device, record.share_id[:8],
                 record.size, record.mechanism, restored)
        return bool(restored)

    def _import(self, record: ParkedShare, fd: int) -> Share:
        if record.backend != self.driver.name:
            raise NotAdopted(f"parked by the {record.backend} backend, this daemon runs {self.driver.name}")
        if record.device_uuid != self.info.uuid:
            raise NotAdopted(f"parked on device {record.device_uuid}, this is {self.info.uuid}")
        if record.share_id in self.sharing.shares:
            raise NotAdopted("a share of that id exists already")
        context = self.contexts.retain_primary_for_share()
        try:
            kind: MemoryKind
            if record.mechanism == "pool":
                pool = self.driver.mem_pool_import_fd(self.device, fd)
                try:
                    ptr = self.driver.mem_pool_import_pointer(pool, record.export_data)
                except BaseException:
                    self.driver.mem_pool_destroy(pool)
                    raise
                self.pools.adopt(ptr, pool, context.context_id, os.dup(fd), record.export_data)
                kind = self.own_pool_memory
            elif record.mechanism == "vmm":
                # Mapped at the size the registry implies, which checks it: cuMemMap refuses a range past the
                # allocation's end, the sim a memfd of another size.
                ptr = self.vmm_memory.adopt(fd, record.size)
                return self._share(record, context, ptr, self.vmm_memory)
            else:
                ptr = self.driver.mem_import_fd(fd, round_to_granularity(record.size))
                kind = self.legacy_memory
            self._check_size(record, ptr, kind)
            return self._share(record, context, ptr, kind)
        except BaseException:
            self.current.activate(context)
            self.contexts.release_primary(context)
            raise

    def _check_size(self, record: ParkedShare, ptr: int, kind: MemoryKind) -> None:
        try:
            base, size = self.driver.mem_get_address_range(ptr)
        except CudaError:
            base, size = -1, -1
        if base != ptr or size < record.size:
            kind.free(ptr)
            raise NotAdopted(f"its memory is {size} bytes at {base:#x}, the registry says {record.size} at {ptr:#x}")

    def _share(self, record: ParkedShare, context: SessionContext, ptr: int, kind: MemoryKind) -> Share:
        publisher = record.publisher
        owner = SessionRef(token="parked-" + secrets.token_hex(16), public_id=_int(publisher.get("session")),
                           client=str(publisher.get("client") or ""), pid=_int(publisher.get("pid")),
                           uid=publisher.get("uid") if isinstance(publisher.get("uid"), int) else None)
        descriptor = ShareDescriptor(share_id=record.share_id, device=self.device, device_uuid=self.info.uuid,
                                     size=record.size, backend=self.driver.name, host=host_identity(),
                                     buffer_id=secrets.token_hex(16), **kind.export(context, ptr))
        # The primary's reference retain_primary_for_share took is the share's own, released when it is freed.
        return Share(descriptor, ptr, context, owner, kind, owner_present=False, persistent=True)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
