"""The daemon-wide index of shared buffers and their published names.

Each share's own record (:class:`cuctxd.daemon.device.entries.Share`) lives on its device's
worker thread; this index lets the front look names up and list shares without asking a worker.

Lifetime rule (PROTOCOL.md, section 9, "Lifetime of shared memory", the one place it is written): a share
is kept alive by its owner (until the owner frees the buffer or its session ends), by every open hold, and by
its published names. A name stays until it is unpublished, its buffer freed by its owner (``free``
unpublishes) or revoked, or, once its owner is gone and nobody holds it, until ``orphan_ttl`` passes
(not for a ``persistent`` name) or the orphan limits evict it
(:meth:`cuctxd.daemon.device.sharing.Sharing.owner_left`). A name published ``once`` is consume-once: it
stops keeping the buffer once a session opened it after its owner let go. The memory is freed once nothing
keeps it alive.

Names have owners. ``lookup`` and ``list_shared`` say who published (session,
client name, pid, uid where known). A *scoped* name ``user/name`` may be
published only by a session whose peer runs as ``user`` (or as the daemon's own
user, or root); other names are first come, first served. A name belongs to the
user who published it: it is removed only by a session of that uid (the
publishing session, a later run of the same producer, ``cuctx unpublish``), or
by one of the daemon's own uid (its administrator). A session whose uid is
unknown (tcp://) can remove only the names it published itself.

Names cost the daemon memory, so they are charged: each name's bytes (its manifest, if any, the name
itself, and ``NAME_OVERHEAD_BYTES`` for what the daemon keeps of any name) count against the session that
published it (``max_manifest_bytes_per_session``) and its uid (``max_manifest_bytes_per_uid``; peers whose
uid the kernel does not tell, tcp://, are one uid, None) until the name goes, and a uid has at most
``max_names_per_uid`` names. A name that outlives its publisher stays charged to the uid.

A name may hold one copy per device (:mod:`cuctxd.daemon.registry.copies`): each a share of its own, the
name's first copy the one it points at here, the others in the :class:`CopyBook`; every copy has the
name's manifest, so one digest vouches for each.

Listing is paged (:meth:`ShareRegistry.page`): the names are kept sorted, daemon-wide and by owner
(:mod:`cuctxd.daemon.registry.name_index`), so no front op costs more than a page however many there are.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import MutableSet
from dataclasses import dataclass
from typing import Any, Protocol

from cuctxd.daemon.registry.copies import Copy, CopyBook
from cuctxd.daemon.registry.name_index import NameFilter, NameIndex
from cuctxd.daemon.registry.names import (
    PLAIN,
    Naming,
    check_name_room,
    check_scope,
    give_back,
    may_unpublish,
    uid_text,
    who_may_unpublish,
)
from cuctxd.daemon.registry.parking import ParkingLot
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.versions import Spare, VersionBook
from cuctxd.daemon.settings import count, size
from cuctxd.protos.errors import BadArgument, LimitExceeded, NameExists, NoCopy, NotFound, NotOwner
from cuctxd.protos.records import ShareDescriptor

#: Default of ``max_manifest_bytes_per_session``: bytes of the names (manifests included) one session publishes.
DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION = 16 << 20
#: Default of ``max_manifest_bytes_per_uid``: the same for one uid, names left by ended sessions included.
DEFAULT_MAX_MANIFEST_BYTES_PER_UID = 64 << 20
#: Default of ``max_names_per_uid``: names one uid's sessions have published, ended ones' included.
DEFAULT_MAX_NAMES_PER_UID = 16384


@dataclass(frozen=True)
class ShareLimits:
    """The bytes and the number of published names (0: no limit; :mod:`cuctxd.daemon.settings`)."""

    #: Bytes of published names (manifests included), per publishing session and per uid, daemon-wide.
    max_manifest_bytes_per_session: int = size(DEFAULT_MAX_MANIFEST_BYTES_PER_SESSION, "bytes of the names "
                                               "(manifests included) one session may have published",
                                               zero="no limit", security=True, limit=True)
    max_manifest_bytes_per_uid: int = size(DEFAULT_MAX_MANIFEST_BYTES_PER_UID, "bytes of the names (manifests "
                                           "included) one user's sessions may have published, ended ones included",
                                           zero="no limit", security=True, limit=True)
    #: Published names of one uid's sessions, ended ones included, daemon-wide.
    max_names_per_uid: int = count(DEFAULT_MAX_NAMES_PER_UID, "names one user's sessions may have published, "
                                   "ended ones included", zero="no limit", security=True, limit=True)


#: How many uids ``status`` lists by the bytes of their names.
_TOP_UIDS = 8
#: Most names one hold of the lock forgets when all of a share's names go (its free, revoke or end).
NAMES_PER_HOLD = 256


class ShareRecord(Protocol):
    """What the index reads of a device's share record (:class:`cuctxd.daemon.device.entries.Share`).

    The record belongs to its device's worker thread; only that thread passes it here.
    """

    @property
    def share_id(self) -> str: ...
    @property
    def descriptor(self) -> ShareDescriptor: ...
    @property
    def owner(self) -> SessionRef: ...
    @property
    def owner_present(self) -> bool: ...
    @property
    def holders(self) -> dict[str, int]: ...
    @property
    def names(self) -> MutableSet[str]: ...


@dataclass
class _Listing:
    descriptor: ShareDescriptor
    owner: SessionRef
    holders: int = 0
    owner_present: bool = True

    def copy_record(self, share_id: str) -> dict[str, Any]:
        """The share as one of its name's ``copies`` in ``list_shared``."""
        return {"device": self.descriptor.device, "uuid": self.descriptor.device_uuid, "share_id": share_id,
                "size": self.descriptor.size, "holders": self.holders, "owner_present": self.owner_present}

    def publisher(self) -> dict[str, Any]:
        """Who exported the buffer: session id, client name, pid and uid (None where unknown)."""
        return {"session": self.owner.public_id, "client": self.owner.client, "pid": self.owner.pid,
                "uid": self.owner.uid}


#: ``list_shared``'s ``verified``: the daemon hashed the bytes and they bore the digest out, or did not.
_VERIFIED: dict[bool | None, str] = {True: "daemon", False: "mismatch"}


class ShareRegistry:
    """Every live share and published name, daemon-wide.

    Shared by the front (lookups, listings, unpublish) and the device workers
    (which create, update and end shares); every method takes the one lock, and
    no method calls out while holding it.
    """

    def __init__(self, limits: ShareLimits = ShareLimits()) -> None:
        """The limits on the bytes of published names and on their number (0: none; module docstring)."""
        self.limits = limits
        self._lock = threading.Lock()
        self._shares: dict[str, _Listing] = {}
        self._names: dict[str, str] = {}
        #: The names in order, daemon-wide and by owner, for pages of ``list_shared``.
        self._index = NameIndex()
        #: What each name was published with (absent: a plain name, :class:`Naming`'s defaults).
        self._namings: dict[str, Naming] = {}
        #: Copies of names whose layout digest the daemon checked against their bytes, by (name, share id): True
        #: where they bore it out, False where they did not (:mod:`cuctxd.daemon.device.digest_checks`); gone with
        #: the copy or the name's naming.
        self._vouched: dict[tuple[str, str], bool] = {}
        #: Each name's copies on other devices than its first's, and the copies staged for a next publish.
        self._copies = CopyBook()
        #: The live versions of versioned names (PROTOCOL.md, section 9, "Versions").
        self.versions: VersionBook[Naming] = VersionBook()
        #: Ids of published shares kept alive by their names alone, on every device.
        self._orphaned: set[str] = set()
        #: Bytes of the published names (:meth:`Naming.charged`) by publishing session token, and by uid.
        self._name_bytes_by_session: dict[str, int] = {}
        self._name_bytes_by_uid: dict[int | None, int] = {}
        #: Where persistent shares are parked to survive the daemon (:mod:`cuctxd.daemon.registry.parking`):
        #: set before the workers start when a service manager keeps fds, else None.
        self.parking: ParkingLot | None = None

    def add(self, share: ShareRecord) -> None:
        with self._lock:
            self._shares[share.share_id] = _Listing(share.descriptor, share.owner)

    def publish(self, name: str, share: ShareRecord, naming: Naming = PLAIN, *, replace: bool = False,
                copy: bool = False, stage: bool = False, version: bool = False) -> list[tuple[str, int]]:
        """Name ``share`` (:func:`check_scope` first), with its layout (checked by the caller) and
        flags. A name in use is :class:`NameExists`, unless ``replace``: then it moves to ``share`` in
        one step if the share's owner may unpublish it (:class:`NotOwner` otherwise), and the share ids
        and devices it left, its copies' included, are returned (each device's worker then forgets the name there,
        :meth:`cuctxd.daemon.device.sharing.Sharing.forget_name`); the copies this session staged for the name
        come in with it. ``copy``/``stage``: :meth:`_add_copy`. :class:`LimitExceeded` naming
        ``max_manifest_bytes_per_session`` or ``max_manifest_bytes_per_uid`` if the name's bytes would
        pass either, or ``max_names_per_uid`` if the uid has that many names (nothing is published or
        replaced then). ``version``: ``share`` becomes the name's next version (:meth:`version_of`), replacing its
        current one as ``replace`` does; a versioned name is replaced only so, and has no copies
        (:class:`BadArgument` otherwise)."""
        if copy or stage:
            self._add_copy(name, share, naming, stage)
            return []
        check_scope(name, share.owner.uid)
        owner = share.owner
        size = naming.charged(name)
        with self._lock:
            share_id = self._names.get(name)
            self._check_staged(name, share, naming)
            credit = (0, 0)  # what the replaced name gives back to this session and this uid
            names_back = 0  # the replaced name, if it was this uid's
            if share_id is not None:
                who = self._shares[share_id].owner
                if not (replace or version):
                    raise NameExists(f"the name {name!r} is already published (by session {who.public_id}, "
                                     f"client {who.client!r}, {uid_text(who.uid)}); {who_may_unpublish(who)} may "
                                     f"unpublish it first (cuctx unpublish {name}), or publish with replace")
                if self.versions.current(name) and not version:
                    raise BadArgument(f"{name!r} is a versioned name: publish its next version (publish with "
                                      "version) instead of replacing it")
                if not may_unpublish(who, owner):
                    raise NotOwner(f"{name!r} was published by session {who.public_id} ({who.client!r}, "
                                   f"{uid_text(who.uid)}); only {who_may_unpublish(who)} may replace it")
                old = self._namings.get(name, PLAIN).charged(name)
                credit = (old if who.token == owner.token else 0, old if who.uid == owner.uid else 0)
                names_back = int(who.uid == owner.uid)
            by_session = self._name_bytes_by_session.get(owner.token, 0) - credit[0]
            by_uid = self._name_bytes_by_uid.get(owner.uid, 0) - credit[1]
            check_name_room("max_manifest_bytes_per_session", self.limits.max_manifest_bytes_per_session, by_session,
                             size, "this session has published")
            user = "peers whose uid is unknown (tcp://)" if owner.uid is None else f"uid {owner.uid}"
            check_name_room("max_manifest_bytes_per_uid", self.limits.max_manifest_bytes_per_uid, by_uid, size,
                             f"the sessions of {user} have published (ended ones included)")
            count = self._index.count_of_uid(owner.uid) - names_back
            if self.limits.max_names_per_uid and count >= self.limits.max_names_per_uid:
                raise LimitExceeded(f"max_names_per_uid: the sessions of {user} have published {count} names that "
                                    f"are still published (ended ones included), the limit; unpublish some first")
            replaced = []
            if share_id is not None:
                replaced = [(c.share_id, c.device) for c in self._forget_name(name) if c.share_id != share.share_id]
                if share_id != share.share_id:
                    replaced.append((share_id, self._shares[share_id].descriptor.device))
            self._name_bytes_by_session[owner.token] = self._name_bytes_by_session.get(owner.token, 0) + size
            self._name_bytes_by_uid[owner.uid] = self._name_bytes_by_uid.get(owner.uid, 0) + size
            self._names[name] = share.share_id
            self._index.add(name, owner)
            if naming != PLAIN:
                self._namings[name] = naming
            if version:
                self.versions.add(name, share.share_id, naming)
            for staged in self._copies.take_staged(owner.token, name):
                self._copies.add(Copy(name, staged.device, staged.share_id))
        share.names.add(name)
        return replaced

    def _check_staged(self, name: str, share: ShareRecord, naming: Naming) -> None:
        """Before a publish (under the lock): :class:`BadArgument` where a copy the publisher staged for the name is
        on the new first copy's device or holds another layout."""
        for staged in self._copies.staged(share.owner.token, name).values():
            if staged.device == share.descriptor.device:
                raise BadArgument(f"a copy of {name!r} is staged on device {staged.device}, the device of the buffer "
                                  "published now: a name holds one copy per device")
            if staged.naming != naming:
                raise BadArgument(f"the copy of {name!r} staged on device {staged.device} holds another layout "
                                  f"(digest {_digest_of(staged.naming)}) than the one published now "
                                  f"({naming.digest}): every copy of a name holds the same content")

    def _add_copy(self, name: str, share: ShareRecord, naming: Naming, staged: bool) -> None:
        """``share`` becomes the copy on its device of ``name``, published already (:class:`NotFound` otherwise)
        with the same naming (:class:`BadArgument` otherwise); ``staged``: the copy waits for this session's next
        publish of the name, which brings it in. Allowed to whoever may unpublish the name (:class:`NotOwner`);
        :class:`NameExists` where the device holds another copy (or staged one) already. A copy is not charged
        as a name: its memory counts on its device."""
        check_scope(name, share.owner.uid)
        device = share.descriptor.device
        with self._lock:
            if self.versions.current(name):
                raise BadArgument(f"{name!r} is a versioned name: a version has no copies on other devices")
            first = self._names.get(name)
            if first is not None:
                who = self._shares[first].owner
                if not may_unpublish(who, share.owner):
                    raise NotOwner(f"{name!r} was published by session {who.public_id} ({who.client!r}, "
                                   f"{uid_text(who.uid)}); only {who_may_unpublish(who)} may add copies of it")
            elif not staged:
                raise NotFound(f"no buffer is published as {name!r}: publish it before adding copies of it")
            known = self._copies.of_share(share.share_id)
            if known is not None and known.name != name:
                raise BadArgument(f"this buffer is a copy of {known.name!r} already; a buffer copies one name")
            if staged:
                held = self._copies.staged(share.owner.token, name).get(device)
                held_id = None if held is None else held.share_id
            else:
                if naming != self._namings.get(name, PLAIN):
                    raise BadArgument(f"a copy of {name!r} holds its layout (digest "
                                      f"{self._namings.get(name, PLAIN).digest}); this one has digest {naming.digest}")
                held_id = self._copy_on(name, device)
            if held_id == share.share_id:
                return
            if held_id is not None:
                raise NameExists(f"{name!r} has a copy {'staged ' if staged else ''}on device {device} already "
                                 f"(share {held_id[:8]}…); unpublish it there first (cuctx unpublish {name} "
                                 f"--device {device})")
            self._copies.add(Copy(name, device, share.share_id, share.owner.token if staged else None,
                                  naming if staged else None))
        share.names.add(name)

    def _copy_on(self, name: str, device: int) -> str | None:
        """The share id of ``name``'s copy on ``device`` (under the lock; the name is published)."""
        first = self._names[name]
        if self._shares[first].descriptor.device == device:
            return first
        copy = self._copies.live(name).get(device)
        return None if copy is None else copy.share_id

    def _copies_of(self, name: str) -> list[str]:
        """The share ids of every copy of ``name``, by device (under the lock; the name is published)."""
        ids = [self._names[name], *(copy.share_id for copy in self._copies.live(name).values())]
        return sorted(ids, key=lambda share_id: self._shares[share_id].descriptor.device)

    def _no_copy(self, name: str, device: int) -> NoCopy:
        where = ", ".join(f"{self._shares[i].descriptor.device} ({self._shares[i].descriptor.device_uuid})"
                          for i in self._copies_of(name))
        return NoCopy(f"{name!r} has no copy on device {device}; it has copies on device {where}. Its publisher "
                      f"may add one (cuctx load CHECKPOINT --name {name} --device {device}, or ensure_copy)")

    def unpublish(self, name: str, caller: SessionRef, device: int | None = None) -> list[tuple[str, int]]:
        """Remove ``name`` if ``caller`` may (module docstring: a session of the publisher's uid, or of the
        daemon's), every copy of it, or with ``device`` only its copy there (:class:`NoCopy` where it has none);
        returns the share id and device of each copy it left."""
        with self._lock:
            share_id = self._names.get(name)
            if share_id is None:
                raise NotFound(f"no buffer is published as {name!r}")
            owner = self._shares[share_id].owner
            if not may_unpublish(owner, caller):
                raise NotOwner(f"{name!r} was published by session {owner.public_id} ({owner.client!r}, "
                               f"{uid_text(owner.uid)}); only {who_may_unpublish(owner)} may unpublish it")
            if device is not None:
                held = self._copy_on(name, device)
                if held is None:
                    raise self._no_copy(name, device)
                self._forget_name(name, held)
                return [(held, device)]
            first = share_id, self._shares[share_id].descriptor.device
            return [first, *((copy.share_id, copy.device) for copy in self._forget_name(name))]

    def withdraw(self, name: str, share: ShareRecord) -> None:
        """``share`` is no copy of ``name`` any more (a publish that failed after naming it): its entry goes (the
        name with it where it was the name's only copy; else another copy takes its place as the first)."""
        with self._lock:
            self._forget_name(name, share.share_id)

    def unstage(self, share: ShareRecord) -> None:
        """``share``'s owner let go of it while it was a staged copy (:meth:`_add_copy`): it is no copy any more."""
        with self._lock:
            copy = self._copies.of_share(share.share_id)
            if copy is None or copy.staged_by is None:
                return
            self._copies.drop(share.share_id)
        share.names.discard(copy.name)

    def count_orphan(self, share_id: str, orphaned: bool) -> None:
        """A device's share became (or stopped being) kept alive by its names alone."""
        with self._lock:
            if orphaned:
                self._orphaned.add(share_id)
            else:
                self._orphaned.discard(share_id)

    def orphan_count(self) -> int:
        """Published shares kept alive by their names alone, daemon-wide (``max_orphaned_shares``)."""
        with self._lock:
            return len(self._orphaned)

    def drop_names(self, share: ShareRecord) -> None:
        self._forget_names(share)
        share.names.clear()

    def update(self, share: ShareRecord) -> None:
        with self._lock:
            listing = self._shares.get(share.share_id)
            if listing is not None:
                listing.holders = sum(share.holders.values())
                listing.owner_present = share.owner_present

    def remove(self, share: ShareRecord) -> None:
        self._forget_names(share)
        with self._lock:
            self._shares.pop(share.share_id, None)
            self.versions.gone(share.share_id)
            self._orphaned.discard(share.share_id)

    def _forget_names(self, share: ShareRecord) -> None:
        """Every name of ``share`` goes, :data:`NAMES_PER_HOLD` per hold of the lock: a share may have thousands
        (16,384 take about 0.1 s), and the front's lookups and pages wait for one turn, not for all. A name not
        gone yet still answers a lookup, as it would have just before."""
        names = list(share.names)
        for start in range(0, len(names), NAMES_PER_HOLD):
            with self._lock:
                for name in names[start:start + NAMES_PER_HOLD]:
                    self._forget_name(name, share.share_id)

    def _forget_name(self, name: str, of_share: str | None = None) -> list[Copy]:
        """The name and what it was published with go, and its bytes are given back (under the lock); returns
        its other copies, forgotten here, whose workers the caller tells. With ``of_share``, only that copy goes:
        a copy other than the first, or the first, whose place another copy takes (the name goes with its last);
        nothing while the name is another share's (a replaced name its old share still lists until its worker
        forgets it is another share's now)."""
        if of_share is not None:
            copy = self._copies.of_share(of_share)
            if copy is not None and copy.name == name:
                self._copies.drop(of_share)
                self._vouched.pop((name, of_share), None)
                return []
            if self._names.get(name) != of_share:
                return []
            promoted = self._copies.promote(name)
            if promoted is not None:
                self._move_first(name, of_share, promoted.share_id)
                return []
        share_id = self._names.pop(name, None)
        naming = self._namings.pop(name, PLAIN)
        self.versions.uncurrent(name)
        copies = self._copies.take_live(name)
        for gone in (share_id, *(copy.share_id for copy in copies)):
            self._vouched.pop((name, gone or ""), None)
        listing = None if share_id is None else self._shares.get(share_id)
        if listing is None:
            return copies
        self._index.discard(name, listing.owner)
        size = naming.charged(name)
        give_back(self._name_bytes_by_session, listing.owner.token, size)
        give_back(self._name_bytes_by_uid, listing.owner.uid, size)
        return copies

    def _move_first(self, name: str, old: str, new: str) -> None:
        """``name``'s first copy went: ``new`` is its first now, and the name's index entry and bytes move to its
        owner (under the lock)."""
        self._names[name] = new
        self._vouched.pop((name, old), None)
        was, now = self._shares[old].owner, self._shares[new].owner
        if was.token == now.token:
            return
        self._index.discard(name, was)
        self._index.add(name, now)
        size = self._namings.get(name, PLAIN).charged(name)
        give_back(self._name_bytes_by_session, was.token, size)
        give_back(self._name_bytes_by_uid, was.uid, size)
        self._name_bytes_by_session[now.token] = self._name_bytes_by_session.get(now.token, 0) + size
        self._name_bytes_by_uid[now.uid] = self._name_bytes_by_uid.get(now.uid, 0) + size

    def names_status(self) -> dict[str, Any]:
        """For ``status``: published names, their bytes, and the uids whose names hold the most (with how many
        names each); O(uids), which are the host's users."""
        with self._lock:
            top = heapq.nlargest(_TOP_UIDS, self._name_bytes_by_uid.items(), key=lambda item: item[1])
            return {"count": len(self._names), "bytes": sum(self._name_bytes_by_uid.values()),
                    "top_uids": [{"uid": uid, "bytes": size, "names": self._index.count_of_uid(uid)}
                                 for uid, size in top]}

    def namings(self, share: ShareRecord) -> dict[str, Naming]:
        """Each name of ``share`` with what it was published with (a copy's name included; a staged copy's with what
        it was staged with: restored after a restart, it comes back as a copy where the name has that content)."""
        with self._lock:
            copy = self._copies.of_share(share.share_id)
            namings = {name: self._namings.get(name, PLAIN) for name in share.names
                       if self._names.get(name) == share.share_id}
            if copy is not None and copy.name in share.names:
                staged = copy.naming if isinstance(copy.naming, Naming) else PLAIN
                namings[copy.name] = self._namings.get(copy.name, PLAIN) if copy.staged_by is None else staged
            return namings

    def lookup(self, name: str, device: int | None = None, version: int | None = None) -> ShareDescriptor:
        """The descriptor published as ``name``, with its ``publisher``: its copy on ``device`` (:class:`NoCopy`
        where it has none), else its first; with ``version``, that live version of a versioned name. Its version's
        number goes with it (0: not versioned), and a versioned name's :meth:`buffers`."""
        with self._lock:
            if version is not None:
                found = self.versions.find(name, version)
                if found is None:
                    raise NotFound(f"{name!r} has no live version {version} (its current one is "
                                   f"{self.versions.current(name) or 'none'})")
                share_id, naming = found
            else:
                share_id = self._find(name, device)
                naming = self._namings.get(name, PLAIN)
            listing = self._shares[share_id]
            number = version or self.versions.current(name)
            buffers = self._buffers(name) if number else ()
        return ShareDescriptor(**{**listing.descriptor.to_wire(), "name": name, "publisher": listing.publisher(),
                                  "manifest": naming.manifest, "read_only": naming.read_only, "version": number,
                                  "buffers": buffers})

    def current_version(self, name: str) -> int:
        """The number of ``name``'s current version (0: none), what ``wait_version`` waits on."""
        with self._lock:
            return self.versions.current(name)

    def version_of(self, name: str, share_id: str) -> int:
        """The number of the version of ``name`` that ``share_id`` holds (0: none)."""
        with self._lock:
            return next((number for named, number, _, _ in self.versions.of_share(share_id) if named == name), 0)

    def versions_of(self, share: ShareRecord) -> list[tuple[str, int, Naming, bool]]:
        """Each (name, number, naming, current) version ``share`` holds (what parking keeps of it)."""
        with self._lock:
            return self.versions.of_share(share.share_id)

    def buffers(self, name: str) -> tuple[str, ...]:
        """The buffer ids of ``name``'s live versions, oldest first, and of its spare: what replies about a
        versioned name carry (``buffers``), so that processes keep mappings of these and drop the others."""
        with self._lock:
            return self._buffers(name)

    def _buffers(self, name: str) -> tuple[str, ...]:
        spare = self.versions.spare(name)
        found = [self._shares[share_id].descriptor.buffer_id for share_id in self.versions.live_shares(name)]
        return (*found, spare.buffer_id) if spare is not None else tuple(found)

    def buffers_of_share(self, share_id: str) -> tuple[str, ...]:
        """:meth:`buffers` of the name whose version ``share_id`` holds (empty where it holds none)."""
        with self._lock:
            return next((self._buffers(name) for name, _, _, _ in self.versions.of_share(share_id)), ())

    def keep_spare(self, name: str, spare: Spare, leaving: str) -> bool:
        """Whether the allocation of share ``leaving``, a version of ``name`` about to be freed, becomes the name's
        spare: yes while the name has another live version and no spare (:mod:`cuctxd.daemon.registry.versions`);
        else it is scrubbed and released as any share."""
        with self._lock:
            return self.versions.keep_spare(name, spare, leaving)

    def is_spare(self, name: str, buffer_id: str) -> bool:
        """Whether the allocation ``buffer_id`` is still ``name``'s spare (its worker releases it otherwise)."""
        with self._lock:
            spare = self.versions.spare(name)
            return spare is not None and spare.buffer_id == buffer_id

    def drop_spare(self, name: str, buffer_id: str) -> None:
        """The allocation ``buffer_id`` is ``name``'s spare no more (its worker releases it)."""
        with self._lock:
            spare = self.versions.spare(name)
            if spare is not None and spare.buffer_id == buffer_id:
                self.versions.drop_spare(name)

    def claim_spare(self, name: str, caller: SessionRef, device: int, size: int) -> tuple[Spare | None, bool]:
        """For ``alloc`` with ``version_of``: ``name``'s spare where ``caller`` may publish the name's next version
        (its scope, and the current version's and the spare's publishers let it) and the spare is on ``device``
        of ``size`` bytes (taken: no longer the name's spare); else None, and whether the name's spare, of
        another size or device, was dropped for the caller's new allocation (its worker releases it)."""
        with self._lock:
            spare = self.versions.spare(name)
            if spare is None or not self._may_publish_next(name, caller, spare):
                return None, False
            self.versions.drop_spare(name)
            if spare.device == device and spare.size == size:
                return spare, False
            return None, True

    def _may_publish_next(self, name: str, caller: SessionRef, spare: Spare) -> bool:
        """Whether ``caller`` may publish ``name``'s next version (under the lock), as :meth:`publish` decides."""
        try:
            check_scope(name, caller.uid)
        except NotOwner:
            return False
        current = self._names.get(name)
        owners = [spare.owner] if current is None else [spare.owner, self._shares[current].owner]
        return all(may_unpublish(owner, caller) for owner in owners)

    def restore_version(self, name: str, share: ShareRecord, naming: Naming, number: int, current: bool) -> None:
        """A version re-adopted at start with its number: recorded, and named again if it was current (as
        :meth:`publish` names it; :class:`NameExists` where the name is taken)."""
        if current:
            self.publish(name, share, naming)
        with self._lock:
            self.versions.add(name, share.share_id, naming, number, current=current)

    def _find(self, name: str, device: int | None) -> str:
        """The share id of ``name``'s copy on ``device`` (None: its first), under the lock."""
        share_id = self._names.get(name)
        if share_id is None:
            raise NotFound(f"no buffer is published as {name!r}")
        if device is None:
            return share_id
        held = self._copy_on(name, device)
        if held is None:
            raise self._no_copy(name, device)
        return held

    def relied_on(self, name: str, device: int | None = None) -> tuple[str, Naming, SessionRef, bool | None]:
        """For a reliance on ``name``'s digest (its copy on ``device``): its share id, what it was published with,
        its publisher, and whether the daemon found its bytes bear the digest out (None: not checked)."""
        with self._lock:
            share_id = self._find(name, device)
            return (share_id, self._namings.get(name, PLAIN), self._shares[share_id].owner,
                    self._vouched.get((name, share_id)))

    def vouch(self, name: str, share_id: str, naming: Naming, matched: bool) -> None:
        """The daemon checked ``naming``'s digest against ``share_id``'s bytes: remembered with the name while it
        still names that share with that naming (``list_shared``'s ``verified``)."""
        with self._lock:
            copy = self._copies.of_share(share_id)
            is_copy = self._names.get(name) == share_id or (copy is not None and copy.name == name
                                                            and copy.staged_by is None)
            if is_copy and self._namings.get(name, PLAIN) == naming:
                self._vouched[(name, share_id)] = matched

    def digested(self, name: str, share_id: str, naming: Naming, computed: Naming) -> bool:
        """The daemon hashed version ``share_id`` of ``name``, published with ``naming`` (no digest), into
        ``computed`` (its manifest with each tensor's digest and the layout's): the version carries it from now
        on, vouched for by the daemon. False, and nothing changes, where that version is gone or carries
        another naming now, or where the longer manifest would pass the publisher's
        ``max_manifest_bytes_per_*`` (it stays without a digest)."""
        with self._lock:
            number = next((n for named, n, known, _ in self.versions.of_share(share_id)
                           if named == name and known == naming), 0)
            if not number:
                return False
            if self._names.get(name) == share_id and self._namings.get(name, PLAIN) == naming:
                owner = self._shares[share_id].owner
                grown = computed.charged(name) - naming.charged(name)
                try:
                    check_name_room("max_manifest_bytes_per_session", self.limits.max_manifest_bytes_per_session,
                                     self._name_bytes_by_session.get(owner.token, 0), grown, "its session has")
                    check_name_room("max_manifest_bytes_per_uid", self.limits.max_manifest_bytes_per_uid,
                                     self._name_bytes_by_uid.get(owner.uid, 0), grown, "its uid has")
                except LimitExceeded:
                    return False
                self._name_bytes_by_session[owner.token] = self._name_bytes_by_session.get(owner.token, 0) + grown
                self._name_bytes_by_uid[owner.uid] = self._name_bytes_by_uid.get(owner.uid, 0) + grown
                self._namings[name] = computed
            self.versions.renamed(name, number, computed)
            self._vouched[(name, share_id)] = True
            return True

    def page(self, which: NameFilter, limit: int) -> tuple[list[dict[str, Any]], bool, int]:
        """Up to ``limit`` of the names ``which`` selects, in code point order, as ``list_shared`` lists them;
        whether more follow; and how many names are published daemon-wide. O(log n + limit) under the lock."""
        with self._lock:
            records: list[dict[str, Any]] = []
            check_uid = which.session is not None and which.uid is not None  # name_index says why
            for name in self._index.matching(which):
                if check_uid and self._shares[self._names[name]].owner.uid != which.uid:
                    continue
                if len(records) == limit:
                    return records, True, len(self._names)
                records.append(self._record(name))
            return records, False, len(self._names)

    def _record(self, name: str) -> dict[str, Any]:
        """One name as ``list_shared`` lists it (under the lock)."""
        share_id = self._names[name]
        listing = self._shares[share_id]
        return {
            **self._namings.get(name, PLAIN).listed(),
            "verified": _VERIFIED.get(self._vouched.get((name, share_id))),
            "name": name,
            "share_id": share_id,
            "device": listing.descriptor.device,
            "size": listing.descriptor.size,
            "owner": listing.owner.public_id,
            "owner_present": listing.owner_present,
            "holders": listing.holders,
            "publisher": listing.publisher(),
            "copies": [self._shares[copy].copy_record(copy) for copy in self._copies_of(name)],
            "version": self.versions.current(name),
        }

    def __len__(self) -> int:
        with self._lock:
            return len(self._shares)


def _digest_of(naming: object) -> str | None:
    return naming.digest if isinstance(naming, Naming) else None
