"""What a new daemon needs to re-adopt a parked share, as the fd store keeps it (PROTOCOL.md, "Parking").

Format 2 (this daemon writes it): one sealed memfd per share, its **record**, stored as
``cuctxd-record-<share id>-<generation>``: msgpack ``{"format": 2, "generation": g, "share": {...}}``
with bytes fields as msgpack bin. A change to one share writes that share's record only, so what a
change costs is its own record's bytes, whatever else is parked.

Format 1 (read at recovery only, so that a daemon upgrade keeps what an older one parked): one
memfd for every share, ``cuctxd-registry-<generation>``, JSON with bytes fields in base64.

Pure functions and frozen records: any thread.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from cuctxd.protos.memfd import resize_sealed

#: The record format this daemon writes; it reads this one and format 1, and skips newer ones (and says so).
FORMAT_VERSION = 2
#: ``FDNAME`` of a parked share's memory: this prefix and its share id.
SHARE_FDNAME = "cuctxd-share-"
#: ``FDNAME`` of a parked share's record: this prefix, its share id, ``-`` and the record's generation.
RECORD_FDNAME = "cuctxd-record-"
#: ``FDNAME`` of a format 1 registry (every share in one memfd): this prefix and its generation.
REGISTRY_FDNAME = "cuctxd-registry-"
#: The most bytes of a record or format 1 registry a daemon reads (a larger one is skipped as corrupt).
MAX_RECORD_BYTES = 256 << 20
_SHARE_ID = re.compile(r"^[0-9a-f]{32}$")
_RECORD_NAME = re.compile(r"^cuctxd-record-([0-9a-f]{32})-([0-9]{1,18})$")


class ParkError(ValueError):
    """A record or registry that cannot be read: corrupt, truncated or of a newer format."""


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

    @property
    def uid(self) -> int | None:
        """The publisher's uid, whose share of the store this share's fds count against (None: unknown)."""
        uid = self.publisher.get("uid")
        return uid if isinstance(uid, int) and not isinstance(uid, bool) else None


def record_fdname(share_id: str, generation: int) -> str:
    return f"{RECORD_FDNAME}{share_id}-{generation}"


def record_of(fdname: str) -> tuple[str, int] | None:
    """(share id, generation) of a record's ``FDNAME``; None for another name."""
    matched = _RECORD_NAME.match(fdname)
    return None if matched is None else (matched.group(1), int(matched.group(2)))


def registry_generation(fdname: str) -> int:
    """The generation of a format 1 registry's ``FDNAME`` (-1 if it has none)."""
    try:
        return int(fdname[len(REGISTRY_FDNAME):])
    except ValueError:
        return -1


def encode_record(share: ParkedShare, generation: int) -> bytes:
    """A share's record, format 2."""
    entry = asdict(share)
    entry["names"] = [asdict(n) for n in share.names]
    return msgpack.packb({"format": FORMAT_VERSION, "generation": generation, "share": entry}, use_bin_type=True)


def decode_record(raw: bytes) -> tuple[int, ParkedShare]:
    """(generation, share) of a format 2 record; :class:`ParkError` for anything it cannot verify."""
    try:
        document = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if not isinstance(document, dict):
            raise ParkError("not a map")
        _check_format(document.get("format"), 2)
        return _typed(document["generation"], int), _share(_typed(document["share"], dict), _raw_bytes)
    except ParkError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as exc:
        raise ParkError(f"corrupt or truncated: {exc!r}") from None


def encode_registry(shares: list[ParkedShare], generation: int) -> bytes:
    """A format 1 registry (what daemons before format 2 wrote; kept to test that it is still read)."""
    entries = []
    for share in shares:
        entry = asdict(share)
        entry["export_data"] = base64.b64encode(share.export_data).decode()
        entry["names"] = [{**asdict(n), "manifest": base64.b64encode(n.manifest).decode()} for n in share.names]
        entries.append(entry)
    return json.dumps({"format": 1, "generation": generation, "shares": entries}, separators=(",", ":")).encode()


def decode_registry(raw: bytes) -> tuple[int, list[ParkedShare]]:
    """(generation, shares) of a format 1 registry; :class:`ParkError` for anything it cannot verify."""
    try:
        document = json.loads(raw)
        if not isinstance(document, dict):
            raise ParkError("not a JSON object")
        _check_format(document.get("format"), 1)
        generation = document["generation"]
        if not isinstance(generation, int):
            raise ParkError("no generation")
        return generation, [_share(entry, _base64) for entry in document["shares"]]
    except ParkError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ParkError(f"corrupt or truncated: {exc!r}") from None


def _check_format(version: Any, expected: int) -> None:
    if not isinstance(version, int) or version < 1:
        raise ParkError(f"no format version ({version!r})")
    if version > FORMAT_VERSION:
        raise ParkError(f"format {version} is newer than this daemon's ({FORMAT_VERSION})")
    if version != expected:
        raise ParkError(f"format {version} under a format {expected} name")


def _base64(value: Any) -> bytes:
    return base64.b64decode(_typed(value, str), validate=True)


def _raw_bytes(value: Any) -> bytes:
    return bytes(_typed(value, bytes))


def _share(entry: dict[str, Any], blob: Any) -> ParkedShare:
    share_id = entry["share_id"]
    if not isinstance(share_id, str) or not _SHARE_ID.match(share_id):
        raise ParkError(f"bad share id {share_id!r}")
    names = tuple(ParkedName(_typed(n["name"], str), blob(n["manifest"]), _typed(n["tensors"], int),
                             _typed(n["read_only"], bool), _typed(n.get("version", 0), int),
                             _typed(n.get("current", True), bool)) for n in entry["names"])
    size = _typed(entry["size"], int)
    if size <= 0:
        raise ParkError(f"share {share_id}: size {size}")
    mechanism = _typed(entry["mechanism"], str)
    if mechanism not in ("pool", "vmm", "ipc"):
        raise ParkError(f"share {share_id}: unknown mechanism {mechanism!r}")
    return ParkedShare(share_id, _typed(entry["device"], int), _typed(entry["device_uuid"], str), size,
                       _typed(entry["backend"], str), mechanism, blob(entry["export_data"]), names,
                       _typed(entry["publisher"], dict))


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ParkError(f"{value!r} is not a {kind.__name__}")
    return value


def read_sealed(fd: int) -> bytes:
    """The bytes of a record or registry memfd; :class:`ParkError` if it is not one or cannot be read."""
    if not resize_sealed(fd):
        raise ParkError("not a sealed memfd")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_RECORD_BYTES:
            raise ParkError(f"{size} bytes, more than {MAX_RECORD_BYTES}")
        raw = os.pread(fd, size, 0)
    except OSError as exc:
        raise ParkError(f"unreadable: {exc}") from None
    if len(raw) != size:
        raise ParkError("truncated")
    return raw
