"""Persistent shares parked with the service manager, so that they survive the daemon (PROTOCOL.md, "Parking").

Under systemd (``$NOTIFY_SOCKET``), each persistent share's memory is kept alive by an fd
in the service manager's file-descriptor store (``FDSTORE=1``, ``FDNAME=cuctxd-share-<id>``),
and what a new daemon needs to rebuild its names, the *parked registry*, by a sealed memfd
stored beside them (``FDNAME=cuctxd-registry-<generation>``): each change stores the next
generation first and then removes the previous one (``FDSTOREREMOVE=1``), so the store always
holds a whole registry. A share freed, unpublished or revoked is removed from the store.

At start (``LISTEN_FDS``, sd_listen_fds(3)) :meth:`ParkingLot.recover` reads the newest
registry that decodes and pairs each of its shares with its fd; the device workers re-import
them (:mod:`cuctxd.daemon.device.parking`). Whatever cannot be verified, a registry that is
corrupt, truncated or of a newer format, an fd without a registry entry or an entry without its
fd, is skipped with a log line and dropped from the store; the daemon starts anyway.

Shared between threads: the device workers park and unpark, the main thread recovers at
start; every method runs under one lock. Calls the store (a datagram to the service manager)
under it, which never blocks for long.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from cuctxd.protos.memfd import resize_sealed, sealed_memfd

log = logging.getLogger(__name__)

#: The parked registry's format; a daemon skips a registry of a newer one (and says so).
FORMAT_VERSION = 1
#: ``FDNAME`` of a parked share's memory: this prefix and its share id.
SHARE_FDNAME = "cuctxd-share-"
#: ``FDNAME`` of the parked registry: this prefix and its generation.
REGISTRY_FDNAME = "cuctxd-registry-"
#: The most bytes of a parked registry a daemon reads (a larger one is skipped as corrupt).
MAX_REGISTRY_BYTES = 256 << 20
_SHARE_ID = re.compile(r"^[0-9a-f]{32}$")


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


class ParkError(ValueError):
    """A parked registry that cannot be read: corrupt, truncated or of a newer format."""


@dataclass(frozen=True)
class ParkedName:
    """A published name of a parked share, with what it was published with; ``version``: the share is that
    version of the name (0: not versioned), its current one unless not ``current``."""

    name: str
    manifest: bytes = b""
    tensors: int = 0
    read_only: bool = False
    version: int = 0
    current: bool = True


@dataclass(frozen=True)
class ParkedShare:
    """What a new daemon needs to re-adopt one share: its memory's kind and size, device, names and publisher.

    ``mechanism``: ``"pool"`` (the fd is its pool's; ``export_data`` names the buffer in it),
    ``"vmm"`` (the fd is its VMM allocation's, ``cuMemExportToShareableHandle``) or
    ``"ipc"`` (the fd is the allocation's own memory: the sim's memfd).
    """

    share_id: str
    device: int
    device_uuid: str
    size: int
    backend: str
    mechanism: str
    export_data: bytes
    names: tuple[ParkedName, ...]
    #: Who published it: ``session``, ``client``, ``pid``, ``uid`` (as ``list_shared`` says).
    publisher: dict[str, Any] = field(default_factory=dict)

    @property
    def fdname(self) -> str:
        return SHARE_FDNAME + self.share_id


def encode(shares: Sequence[ParkedShare], generation: int) -> bytes:
    """The parked registry: JSON, bytes fields in base64."""
    entries = []
    for share in shares:
        entry = asdict(share)
        entry["export_data"] = base64.b64encode(share.export_data).decode()
        entry["names"] = [{**asdict(n), "manifest": base64.b64encode(n.manifest).decode()} for n in share.names]
        entries.append(entry)
    return json.dumps({"format": FORMAT_VERSION, "generation": generation, "shares": entries},
                      separators=(",", ":")).encode()


def decode(raw: bytes) -> tuple[int, list[ParkedShare]]:
    """(generation, shares) of a parked registry; :class:`ParkError` for anything it cannot verify."""
    try:
        document = json.loads(raw)
        if not isinstance(document, dict):
            raise ParkError("not a JSON object")
        version = document.get("format")
        if not isinstance(version, int) or version < 1:
            raise ParkError(f"no format version ({version!r})")
        if version > FORMAT_VERSION:
            raise ParkError(f"format {version} is newer than this daemon's ({FORMAT_VERSION})")
        generation = document["generation"]
        if not isinstance(generation, int):
            raise ParkError("no generation")
        return generation, [_share(entry) for entry in document["shares"]]
    except ParkError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ParkError(f"corrupt or truncated: {exc!r}") from None


def _share(entry: dict[str, Any]) -> ParkedShare:
    share_id = entry["share_id"]
    if not isinstance(share_id, str) or not _SHARE_ID.match(share_id):
        raise ParkError(f"bad share id {share_id!r}")
    names = tuple(ParkedName(_typed(n["name"], str), base64.b64decode(n["manifest"], validate=True),
                             _typed(n["tensors"], int), _typed(n["read_only"], bool),
                             _typed(n.get("version", 0), int), _typed(n.get("current", True), bool))
                  for n in entry["names"])
    size = _typed(entry["size"], int)
    if size <= 0:
        raise ParkError(f"share {share_id}: size {size}")
    mechanism = _typed(entry["mechanism"], str)
    if mechanism not in ("pool", "vmm", "ipc"):
        raise ParkError(f"share {share_id}: unknown mechanism {mechanism!r}")
    return ParkedShare(share_id, _typed(entry["device"], int), _typed(entry["device_uuid"], str), size,
                       _typed(entry["backend"], str), mechanism,
                       base64.b64decode(entry["export_data"], validate=True), names,
                       _typed(entry["publisher"], dict))


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ParkError(f"{value!r} is not a {kind.__name__}")
    return value


@dataclass
class Recovered:
    """What :meth:`ParkingLot.recover` found: each share to re-adopt with its fd (the caller's to close)."""

    shares: list[tuple[ParkedShare, int]] = field(default_factory=list)
    skipped: int = 0


class ParkingLot:
    """The daemon's parked shares and their registry in the service manager's fd store (module docstring)."""

    def __init__(self, store: FdStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._parked: dict[str, ParkedShare] = {}
        self._generation = 0
        #: The registry's FDNAMEs now in the store (normally one).
        self._registries: list[str] = []

    @property
    def room(self) -> int | None:
        """How many more shares may be parked (the store's limit less the shares and two registries), or None."""
        limit = self.store.limit
        with self._lock:
            return None if limit is None else max(0, limit - 2 - len(self._parked))

    def parked(self, share_id: str) -> ParkedShare | None:
        with self._lock:
            return self._parked.get(share_id)

    def park(self, share: ParkedShare, fd: int) -> bool:
        """Store ``fd`` (the caller keeps and closes its copy) as the share's memory and record it; False (and a
        log line) if the store is full or refused it."""
        with self._lock:
            limit = self.store.limit
            if limit is not None and len(self._parked) + 2 >= limit:
                log.warning("share %s… (names %s) not parked: the service manager's fd store is full "
                            "(FileDescriptorStoreMax=%d); a restart forgets it", share.share_id[:8],
                            [n.name for n in share.names], limit)
                return False
            if not self.store.store(share.fdname, fd):
                return False
            self._parked[share.share_id] = share
            self._write()
        log.info("parked share %s… (%d bytes on device %d, names %s) with the service manager",
                 share.share_id[:8], share.size, share.device, [n.name for n in share.names])
        return True

    def update(self, share: ParkedShare) -> None:
        """A parked share's names (or publisher) changed: store the registry again if it differs."""
        with self._lock:
            if self._parked.get(share.share_id) not in (None, share):
                self._parked[share.share_id] = share
                self._write()

    def unpark(self, share_id: str) -> None:
        """The share is gone (or no longer persistent): out of the store and the registry."""
        with self._lock:
            share = self._parked.pop(share_id, None)
            if share is None:
                return
            self.store.remove(share.fdname)
            self._write()
        log.info("share %s… unparked (names %s)", share_id[:8], [n.name for n in share.names])

    def forget(self, name: str, why: str) -> None:
        """Drop an fd the daemon cannot use from the store (it would otherwise come back at every start)."""
        log.warning("dropping %s from the service manager's fd store: %s", name, why)
        self.store.remove(name)

    def _write(self) -> None:
        """Store the next generation of the registry, then remove the previous ones (under the lock); with no
        share parked, only remove them."""
        if not self._parked:
            for old in self._registries:
                self.store.remove(old)
            self._registries = []
            return
        self._generation += 1
        name = f"{REGISTRY_FDNAME}{self._generation}"
        raw = encode(list(self._parked.values()), self._generation)
        try:
            fd = sealed_memfd("cuctxd-registry", len(raw))
        except OSError as exc:
            log.error("cannot write the parked registry: %s; a restart may forget recent changes", exc)
            return
        try:
            os.pwrite(fd, raw, 0)
            stored = self.store.store(name, fd)
        finally:
            os.close(fd)
        if not stored:
            return
        for old in self._registries:
            self.store.remove(old)
        self._registries = [name]

    # --- at start -------------------------------------------------------------------------

    def recover(self, fds: Sequence[tuple[str, int]]) -> Recovered:
        """Pair the shares of the newest readable registry among ``fds`` (from sd_listen_fds) with their fds.

        Every fd not returned is closed here; what is skipped is logged and removed from the store. The
        registries found are removed once :meth:`adopted` has stored the next one (:meth:`commit`).
        """
        recovered = Recovered()
        registries: list[tuple[int, str, int]] = []
        memory: dict[str, int] = {}
        for name, fd in fds:
            if name.startswith(REGISTRY_FDNAME):
                registries.append((_generation(name), name, fd))
            elif name.startswith(SHARE_FDNAME) and name not in memory:
                memory[name] = fd
            else:
                os.close(fd)
                recovered.skipped += 1
                self.forget(name, "not a name cuctxd stores (or stored twice)")
        chosen: list[ParkedShare] | None = None
        for generation, name, fd in sorted(registries, reverse=True):
            self._generation = max(self._generation, generation)  # a later registry never takes a name found
            try:
                if chosen is None:
                    _, chosen = decode(_read_registry(fd))
            except ParkError as exc:
                log.error("the parked registry %s cannot be used (%s): its shares are not adopted", name, exc)
                recovered.skipped += 1
            finally:
                os.close(fd)
            self._registries.append(name)
        for share in chosen or ():
            fd = memory.pop(share.fdname, -1)
            if fd < 0:
                log.error("parked share %s… (names %s) has no fd in the store: skipped", share.share_id[:8],
                          [n.name for n in share.names])
                recovered.skipped += 1
                continue
            recovered.shares.append((share, fd))
        for name, fd in memory.items():
            os.close(fd)
            recovered.skipped += 1
            self.forget(name, "no entry in a readable parked registry")
        return recovered

    def adopted(self, share: ParkedShare, fd: int) -> None:
        """A share re-adopted at start: keep its fd stored (sent again; the store does not keep an fd twice)."""
        with self._lock:
            self.store.store(share.fdname, fd)
            self._parked[share.share_id] = share

    def close(self) -> None:
        """At the daemon's end, once the workers stopped: what is parked stays in the store."""
        with self._lock:
            self.store.close()

    def commit(self) -> None:
        """After every adoption at start: store the registry of what was adopted and remove the old ones."""
        with self._lock:
            self._write()


def _generation(name: str) -> int:
    try:
        return int(name[len(REGISTRY_FDNAME):])
    except ValueError:
        return -1


def _read_registry(fd: int) -> bytes:
    """The bytes of a parked registry memfd; :class:`ParkError` if it is not one or cannot be read."""
    if not resize_sealed(fd):
        raise ParkError("not a sealed memfd")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_REGISTRY_BYTES:
            raise ParkError(f"{size} bytes, more than {MAX_REGISTRY_BYTES}")
        raw = os.pread(fd, size, 0)
    except OSError as exc:
        raise ParkError(f"unreadable: {exc}") from None
    if len(raw) != size:
        raise ParkError("truncated")
    return raw
