"""Persistent shares parked with the service manager, so that they survive the daemon (PROTOCOL.md, "Parking").

Under systemd (``$NOTIFY_SOCKET``), each persistent share's memory is kept alive by an fd
in the service manager's file-descriptor store (``FDSTORE=1``, ``FDNAME=cuctxd-share-<id>``),
and what a new daemon needs to rebuild its names, its *record*, by a sealed memfd stored beside it
(``FDNAME=cuctxd-record-<id>-<generation>``, :mod:`cuctxd.daemon.registry.parked_records`). Parking
stores the memory, then the record; a change stores the share's next record, then removes its previous
one (``FDSTOREREMOVE=1``); unparking removes the record, then the memory. So the store always holds
a whole record for every share it keeps, and a change costs that share's record alone. Generations
count daemon-wide: where two records claim one name at recovery (a ``replace`` cut short), the newer wins.

Every method that changes the store returns once the datagrams carrying the change were sent: the
reply that acknowledges it goes out after, so a SIGKILL after the reply finds the change in the store.
Each uid's shares may hold ``max_parked_fds_per_uid`` of the store's fds, and every parked fd counts
against the daemon's fd budget (a new daemon holds them all at start): a share that does not fit is
refused with :class:`~cuctxd.protos.errors.NotParked`.

At start (``LISTEN_FDS``, sd_listen_fds(3)) :meth:`ParkingLot.recover` pairs the newest readable
record of each share (or, from a daemon before format 2, the newest readable registry's entry) with
its memory's fd; the device workers re-import them (:mod:`cuctxd.daemon.device.parking`). Whatever
cannot be verified is skipped with a log line and dropped from the store; the daemon starts anyway.

Shared between threads: the device workers park and unpark, the main thread recovers at start, the
front reads :meth:`to_status`; every method runs under one lock. Calls the store (a datagram to the
service manager) under it, which never blocks for long.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cuctxd.daemon.registry.fd_budget import FdBudget, FdCharge
from cuctxd.daemon.registry.parked_records import (
    REGISTRY_FDNAME,
    SHARE_FDNAME,
    ParkedName,
    ParkedShare,
    ParkError,
    decode_record,
    decode_registry,
    encode_record,
    read_sealed,
    record_fdname,
    record_of,
    registry_generation,
)
from cuctxd.daemon.settings import count
from cuctxd.protos.errors import LimitExceeded, NotParked
from cuctxd.protos.memfd import sealed_memfd

log = logging.getLogger(__name__)

#: Store fds a parked share holds: its memory and its record.
FDS_PER_SHARE = 2
#: Uids listed in ``status`` (those holding the most).
STATUS_UIDS = 8


class FdStore(Protocol):
    """The service manager's fd store (:class:`cuctxd.daemon.service.fdstore.ServiceFdStore`)."""

    #: The most fds it keeps (``$FDSTORE``), or None where the service manager did not say.
    limit: int | None

    def store(self, name: str, fd: int) -> bool:
        """Send ``fd`` (a copy stays with the caller) with ``FDSTORE=1`` and ``FDNAME=name``; False if it failed."""

    def remove(self, name: str) -> bool:
        """``FDSTOREREMOVE=1`` with ``FDNAME=name``."""

    def close(self) -> None:
        """No more datagrams (the daemon is done)."""


def per_uid_share(limit: int | None, configured: int) -> int:
    """``max_parked_fds_per_uid`` in effect: ``configured`` (at most the store), else a quarter of the store;
    0 (no share) where the store has no known limit and none is configured."""
    if limit is None:
        return configured
    if configured > limit:
        log.warning("max_parked_fds_per_uid %d is more than the fd store keeps (%d): using %d", configured, limit,
                    limit)
        return limit
    return configured or max(FDS_PER_SHARE, limit // 4)


@dataclass
class Recovered:
    """What :meth:`ParkingLot.recover` found: each share to re-adopt with its fd (the caller's to close)."""

    shares: list[tuple[ParkedShare, int]] = field(default_factory=list)
    skipped: int = 0


@dataclass(frozen=True)
class ParkingLimits:
    """The fd store's share of one uid (:mod:`cuctxd.daemon.settings`)."""

    #: fds of the service manager's fd store one uid's parked shares may hold (two each; 0: a quarter of the store).
    max_parked_fds_per_uid: int = count(0, "most fds of the service manager's fd store one user's parked "
                                        "(persistent) shares may hold, two each", shown="0: a quarter of the "
                                        "store ($FDSTORE)", security=True, limit=True)


class ParkingLot:
    """The daemon's parked shares and their records in the service manager's fd store (module docstring)."""

    def __init__(self, store: FdStore, budget: FdBudget | None = None, limits: ParkingLimits = ParkingLimits()) -> None:
        self.store = store
        self.budget = budget
        self.per_uid = per_uid_share(store.limit, limits.max_parked_fds_per_uid)
        self._lock = threading.Lock()
        self._parked: dict[str, ParkedShare] = {}
        #: Each parked share's record in the store, by share id.
        self._records: dict[str, str] = {}
        self._charges: dict[str, FdCharge | None] = {}
        #: Store fds of each uid's parked shares.
        self._by_uid: dict[int | None, int] = {}
        #: Format 1 registries (and records of shares not adopted yet) in the store until :meth:`commit`.
        self._stale: list[str] = []
        self._generation = 0
        #: Records stored, and their bytes, since start (what a change costs: its own record).
        self.records_written = 0
        self.record_bytes_written = 0
        self.refused = 0

    def parked(self, share_id: str) -> ParkedShare | None:
        with self._lock:
            return self._parked.get(share_id)

    def check_room(self, uid: int | None) -> None:
        """:class:`NotParked` when a new share of ``uid`` would not fit the store or the uid's share of it."""
        with self._lock:
            refusal = self._refusal(uid)
            if refusal is not None:
                self.refused += 1
                raise NotParked(refusal)

    def park(self, share: ParkedShare, fd: int) -> None:
        """Store ``fd`` (the caller keeps and closes its copy) as the share's memory, then its record; returns once
        both were sent. :class:`NotParked` (nothing stays stored) where it does not fit or the store refused."""
        with self._lock:
            refusal = self._refusal(share.uid)
            if refusal is not None:
                self.refused += 1
                raise NotParked(refusal)
            charge = self._charge(share)
            if not self.store.store(share.fdname, fd):
                _release(charge)
                raise NotParked("the service manager's fd store did not take the share's fd (see the daemon log)")
            if not self._write_record(share):
                self.store.remove(share.fdname)
                _release(charge)
                raise NotParked("the share's record could not be stored with the service manager (see the daemon "
                                "log)")
            self._parked[share.share_id] = share
            self._charges[share.share_id] = charge
            self._by_uid[share.uid] = self._by_uid.get(share.uid, 0) + FDS_PER_SHARE
        log.info("parked share %s… (%d bytes on device %d, names %s) with the service manager",
                 share.share_id[:8], share.size, share.device, [n.name for n in share.names])

    def update(self, share: ParkedShare) -> None:
        """A parked share's names (or publisher) changed: store its next record, then remove the previous one.
        :class:`NotParked` if the store did not take it (the previous record stays)."""
        with self._lock:
            if self._parked.get(share.share_id) in (None, share):
                return
            previous = self._records.get(share.share_id)
            if not self._write_record(share):
                raise NotParked("the share's new record could not be stored with the service manager (see the "
                                "daemon log); a restart finds its previous names")
            if previous is not None:
                self.store.remove(previous)
            self._parked[share.share_id] = share

    def unpark(self, share_id: str) -> None:
        """The share is gone (or no longer persistent): its record, then its memory, out of the store."""
        with self._lock:
            share = self._parked.pop(share_id, None)
            if share is None:
                return
            record = self._records.pop(share_id, None)
            if record is not None:
                self.store.remove(record)
            self.store.remove(share.fdname)
            _release(self._charges.pop(share_id, None))
            left = self._by_uid.get(share.uid, 0) - FDS_PER_SHARE
            if left > 0:
                self._by_uid[share.uid] = left
            else:
                self._by_uid.pop(share.uid, None)
        log.info("share %s… unparked (names %s)", share_id[:8], [n.name for n in share.names])

    def forget(self, name: str, why: str) -> None:
        """Drop an fd the daemon cannot use from the store (it would otherwise come back at every start)."""
        log.warning("dropping %s from the service manager's fd store: %s", name, why)
        self.store.remove(name)

    def to_status(self) -> dict[str, Any]:
        """For ``status`` (any thread): the store's use, in all and by the uids holding the most."""
        with self._lock:
            top = sorted(self._by_uid.items(), key=lambda item: -item[1])[:STATUS_UIDS]
            return {"store_max": self.store.limit, "fds": self._used(), "shares": len(self._parked),
                    "max_per_uid": self.per_uid or None, "uids": [{"uid": uid, "fds": fds} for uid, fds in top],
                    "refused": self.refused, "records_written": self.records_written,
                    "record_bytes_written": self.record_bytes_written}

    def _used(self) -> int:
        return FDS_PER_SHARE * len(self._parked) + len(self._stale)

    def _refusal(self, uid: int | None) -> str | None:
        """Why a new share of ``uid`` does not fit (under the lock): the store keeps a slot spare for a record's
        next generation, stored before the previous one is removed."""
        limit = self.store.limit
        used = self._used()
        if limit is not None and used + FDS_PER_SHARE + 1 > limit:
            return (f"the service manager's fd store is full: {used} of its {limit} fds "
                    f"(FileDescriptorStoreMax=) are parked shares, each {FDS_PER_SHARE}; unpublish persistent names "
                    "first, or publish without persistent (a restart then forgets the name)")
        held = self._by_uid.get(uid, 0)
        if self.per_uid and held + FDS_PER_SHARE > self.per_uid:
            who = "the peers whose uid is unknown (tcp://)" if uid is None else f"uid {uid}"
            return (f"max_parked_fds_per_uid: {who} has {held} fds parked in the service manager's fd store, of "
                    f"its share of {self.per_uid}; a parked share takes {FDS_PER_SHARE}; unpublish some of its "
                    "persistent names first")
        return None

    def _charge(self, share: ParkedShare) -> FdCharge | None:
        """Count the share's store fds against the fd budget (a new daemon holds them all at start)."""
        if self.budget is None:
            return None
        try:
            return self.budget.charge(FDS_PER_SHARE, "a parked share", _budget_peer(share.uid))
        except LimitExceeded as exc:
            self.refused += 1
            raise NotParked(f"its fds would pass the fd budget: {exc.message}") from None

    def _write_record(self, share: ParkedShare) -> bool:
        """Store the share's next record (under the lock); False (and a log line) if it could not be."""
        self._generation += 1
        name = record_fdname(share.share_id, self._generation)
        raw = encode_record(share, self._generation)
        try:
            fd = sealed_memfd("cuctxd-record", len(raw))
        except OSError as exc:
            log.error("cannot write share %s…'s parked record: %s", share.share_id[:8], exc)
            return False
        try:
            os.pwrite(fd, raw, 0)
            stored = self.store.store(name, fd)
        except OSError as exc:
            log.error("cannot write share %s…'s parked record: %s", share.share_id[:8], exc)
            stored = False
        finally:
            os.close(fd)
        if stored:
            self._records[share.share_id] = name
            self.records_written += 1
            self.record_bytes_written += len(raw)
        return stored

    # --- at start -------------------------------------------------------------------------

    def recover(self, fds: Sequence[tuple[str, int]]) -> Recovered:
        """Pair the newest readable record of each share among ``fds`` (from sd_listen_fds) with its memory's fd.

        Every fd not returned is closed here; what is skipped is logged and removed from the store. The
        records and registries read stay stored until :meth:`commit`, after the adoptions.
        """
        recovered = Recovered()
        found: dict[str, tuple[int, ParkedShare, str | None]] = {}
        memory: dict[str, int] = {}
        records: list[tuple[int, str, str, int]] = []
        registries: list[tuple[int, str, int]] = []
        for name, fd in fds:
            named = record_of(name)
            if named is not None:
                records.append((named[1], named[0], name, fd))
            elif name.startswith(REGISTRY_FDNAME):
                registries.append((registry_generation(name), name, fd))
            elif name.startswith(SHARE_FDNAME) and name not in memory:
                memory[name] = fd
            else:
                os.close(fd)
                recovered.skipped += 1
                self.forget(name, "not a name cuctxd stores (or stored twice)")
        registry_read = False
        for generation, name, fd in sorted(registries, reverse=True):
            self._generation = max(self._generation, generation)
            self._stale.append(name)
            if registry_read:
                os.close(fd)  # only the newest readable registry counts
                continue
            read = self._read(name, fd, registry=True)
            registry_read = read is not None
            recovered.skipped += read is None
            for generation_read, share in read or ():
                found.setdefault(share.share_id, (generation_read, share, None))
        for generation, share_id, name, fd in sorted(records, reverse=True):
            self._generation = max(self._generation, generation)
            self._stale.append(name)
            read = self._read(name, fd, registry=False)
            recovered.skipped += read is None
            for generation_read, share in read or ():
                if share.share_id != share_id or generation_read != generation:
                    log.error("the parked record %s names share %s… generation %d: skipped", name,
                              share.share_id[:8], generation_read)
                    recovered.skipped += 1
                elif found.get(share_id, (-1,))[0] < generation:
                    found[share_id] = (generation, share, name)
        claimed: set[Any] = set()
        for _, share, record in sorted(found.values(), key=lambda entry: -entry[0]):
            share = self._unclaimed(share, claimed)
            fd = memory.pop(share.fdname, -1)
            if fd < 0 or not share.names:
                why = "has no fd in the store" if fd < 0 else "lost every name to newer records"
                log.error("parked share %s… %s: skipped", share.share_id[:8], why)
                recovered.skipped += 1
                if fd >= 0:
                    os.close(fd)
                    self.forget(share.fdname, why)
                continue
            if record is not None:
                self._stale.remove(record)
                self._records[share.share_id] = record
            recovered.shares.append((share, fd))
        for name, fd in memory.items():
            os.close(fd)
            recovered.skipped += 1
            self.forget(name, "no entry in a readable parked record")
        return recovered

    @staticmethod
    def _read(name: str, fd: int, *, registry: bool) -> list[tuple[int, ParkedShare]] | None:
        """The (generation, share) pairs a record or registry holds (closing ``fd``); None and a log line if it
        cannot be read."""
        try:
            raw = read_sealed(fd)
            if registry:
                generation, shares = decode_registry(raw)
                return [(generation, share) for share in shares]
            return [decode_record(raw)]
        except ParkError as exc:
            log.error("the parked %s %s cannot be used (%s): its shares are not adopted",
                      "registry" if registry else "record", name, exc)
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _unclaimed(share: ParkedShare, claimed: set[Any]) -> ParkedShare:
        """``share`` without the names a newer record claimed on its device (each name's copy on a device goes to
        the newest record naming it there: a name holds one copy per device; an older version of a name, not
        current, claims only its own number)."""
        names = tuple(n for n in share.names if (_claim(n), share.device_uuid) not in claimed)
        if len(names) != len(share.names):
            log.warning("parked share %s…: names %s go to newer records", share.share_id[:8],
                        sorted({n.name for n in share.names} - {n.name for n in names}))
        claimed.update((_claim(n), share.device_uuid) for n in names)
        return share if len(names) == len(share.names) else ParkedShare(**{**share.__dict__, "names": names})

    def adopted(self, share: ParkedShare, fd: int) -> None:
        """A share re-adopted at start: keep its fd stored (sent again; the store does not keep an fd twice)."""
        with self._lock:
            self.store.store(share.fdname, fd)
            self._parked[share.share_id] = share
            try:
                charge = self._charge(share)
            except NotParked as exc:
                log.warning("adopted share %s…: %s", share.share_id[:8], exc)
                charge = None
            self._charges[share.share_id] = charge
            self._by_uid[share.uid] = self._by_uid.get(share.uid, 0) + FDS_PER_SHARE

    def close(self) -> None:
        """At the daemon's end, once the workers stopped: what is parked stays in the store."""
        with self._lock:
            self.store.close()

    def commit(self) -> None:
        """After every adoption at start: store a record for each adopted share that has none (from a format 1
        registry), then remove the registries and the records no adopted share keeps."""
        with self._lock:
            for share_id, share in self._parked.items():
                if share_id not in self._records:
                    self._write_record(share)
            for share_id in [share_id for share_id in self._records if share_id not in self._parked]:
                self._stale.append(self._records.pop(share_id))
            for name in self._stale:
                self.store.remove(name)
            self._stale = []


def _budget_peer(uid: int | None) -> str:
    return "parked, uid unknown" if uid is None else f"parked, uid {uid}"


def _release(charge: FdCharge | None) -> None:
    if charge is not None:
        charge.release()


def _claim(name: ParkedName) -> Any:
    """What a parked name claims at recovery: the name, or an older version's (name, number)."""
    return name.name if name.current else (name.name, name.version)
