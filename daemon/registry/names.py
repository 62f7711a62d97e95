"""Who may publish or remove a name, and what a name carries and costs (PROTOCOL.md, section 9, "Exporting and
publishing"): the rules :class:`~cuctxd.daemon.registry.shares.ShareRegistry` applies under its lock. Pure
functions and frozen values; any thread.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from typing import Any

from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.protos.errors import LimitExceeded, NotOwner
from cuctxd.protos.limits import NAME_OVERHEAD_BYTES


@dataclass(frozen=True)
class Naming:
    """What a published name carries besides its share: the tensor layout's manifest (packed), tensor
    count and digest (from the checked manifest), and whether openers are to map it read-only."""

    manifest: bytes = b""
    tensors: int = 0
    read_only: bool = False
    digest: str | None = None

    def listed(self) -> dict[str, Any]:
        """What ``list_shared`` says of the name's layout and mode."""
        return {"tensors": self.tensors, "read_only": self.read_only, "digest": self.digest}

    def charged(self, name: str) -> int:
        """What the name costs its publisher (``max_manifest_bytes_per_*``): its manifest, its own bytes, and
        what the daemon keeps of any name (``NAME_OVERHEAD_BYTES``)."""
        return len(self.manifest) + len(name.encode()) + NAME_OVERHEAD_BYTES


#: A name published with nothing but its share.
PLAIN = Naming()


def check_scope(name: str, uid: int | None) -> None:
    """Refuse a scoped name ``user/...`` unless ``uid`` is that user's, the daemon's own, or root's."""
    scope, slash, _ = name.partition("/")
    if not slash:
        return
    if uid is None:
        raise NotOwner(f"{name!r} is scoped to user {scope!r}, and the daemon cannot tell which user this "
                       "session runs as (only ipc:// connections say); publish an unscoped name")
    if uid in (0, os.geteuid()):
        return
    try:
        owner_uid = pwd.getpwnam(scope).pw_uid
    except KeyError:
        owner_uid = None
    if owner_uid != uid:
        raise NotOwner(f"{name!r} is scoped to user {scope!r}; this session runs as uid {uid}")


def may_unpublish(owner: SessionRef, caller: SessionRef) -> bool:
    """Whether ``caller`` may remove a name ``owner`` published: the same session, a session of the same
    (known) uid, or one of the daemon's own uid."""
    if caller.token == owner.token:
        return True
    return caller.uid is not None and caller.uid in (owner.uid, os.geteuid())


def uid_text(uid: int | None) -> str:
    return "uid unknown (tcp://)" if uid is None else f"uid {uid}"


def who_may_unpublish(owner: SessionRef) -> str:
    if owner.uid is None:
        return f"session {owner.public_id} itself (its uid is unknown) or the daemon's user (uid {os.geteuid()})"
    if owner.uid == os.geteuid():
        return f"a session of uid {owner.uid} (the daemon's user)"
    return f"a session of uid {owner.uid} or of the daemon's user (uid {os.geteuid()})"


def check_name_room(limit_name: str, limit: int, used: int, size: int, whose: str) -> None:
    if limit and used + size > limit:
        raise LimitExceeded(f"{limit_name}: {whose} names (manifests included) of {used} bytes that are still "
                            f"published; this one's {size} bytes would pass the limit of {limit}; unpublish some first")


def give_back(tally: dict[Any, int], key: Any, size: int) -> None:
    left = tally.get(key, 0) - size
    if left > 0:
        tally[key] = left
    else:
        tally.pop(key, None)
