"""Ops for sharing memory between processes, and the session lease (protocol version 1).

A buffer is shared by *exporting* it (a share descriptor naming its pool and
the pointer's export data, or the backend's legacy IPC handle) and, optionally,
*publishing* it under a name. Another session *opens* the share (the daemon
records the hold) and maps it in its own process; it *closes* it when done. The daemon frees shared memory only once
its owner has freed it and no session still holds it open.
"""

from __future__ import annotations

import dataclasses

from cuctxd.protos.limits import MAX_LISTED, MAX_VERSION_WAIT_MS
from cuctxd.protos.schema import count_field, handle_field, name_field, op


@op("heartbeat", target="front")
class Heartbeat:
    """Renew the session's lease (every request does; this one does nothing else).
    Result: ``lease_ttl`` (seconds)."""


@op("export", target="device")
class Export:
    """Make a buffer this session owns shareable (``cuIpcGetMemHandle``).
    Result: ``share`` (share descriptor)."""

    buffer: int = handle_field()
    device: int | None = count_field(default=None)


@op("publish", target="device")
class Publish:
    """Export a buffer and publish it under ``name``, visible to every session; with ``manifest`` (a
    packed layout, :mod:`cuctxd.protos.layouts`), as the tensors it lists. A name keeps the buffer
    alive until it is unpublished or, once its owner is gone and nobody holds it, ``orphan_ttl``
    passes (PROTOCOL.md, "Lifetime of shared memory"); ``persistent``: no ``orphan_ttl`` (and parked
    where a service manager keeps fds); ``once``: consume-once, the name stops keeping it once a
    session opened it after its owner let go; ``read_only``: openers are told to map it without
    write access (``read_only`` in the descriptor); ``replace``: a name already published moves to this
    buffer at once, if this session may unpublish it (holders of the old one keep it; the name's copies on
    other devices go with it, and the buffers published ``stage`` for it come in with it); ``copy``: the
    buffer becomes the copy on its device of a name already published elsewhere, with the same manifest
    (PROTOCOL.md, section 9, "Copies on several devices"); ``stage``: that copy is held for the next
    ``replace`` of the name, not published before it; ``version``: publish the name's next version
    (PROTOCOL.md, section 9, "Versions"): persistent, replacing the current one, and the buffer handed to the
    name (this session's handle goes); not with ``copy`` or ``stage``. Result: ``share`` (with ``version``)."""

    buffer: int = handle_field()
    name: str = name_field()
    device: int | None = count_field(default=None)
    manifest: bytes | None = None
    persistent: bool = False
    read_only: bool = False
    once: bool = False
    replace: bool = False
    copy: bool = False
    stage: bool = False
    version: bool = False


@op("unpublish", target="front")
class Unpublish:
    """Remove a name published by a session of this session's user (or, for the daemon's own user, any
    name), every copy of it; with ``device``, only its copy on that device. Holders keep their mappings.
    Result: ``{}``."""

    name: str = name_field()
    device: int | None = count_field(default=None)


@op("lookup", target="front")
class Lookup:
    """The share descriptor published under ``name``, with its ``publisher`` (session, client,
    pid, uid): its copy on ``device`` (``CUCTXD_ERROR_NO_COPY`` where it has none), else its first copy;
    ``version``: that live version of a versioned name instead of its current one. Result: ``share``."""

    name: str = name_field()
    device: int | None = count_field(default=None)
    version: int | None = count_field(default=None, minimum=1)


@op("wait_version", target="device")
class WaitVersion:
    """Answer once ``name`` has a current version newer than ``after`` (at once if it has), or fail with
    ``CUCTXD_ERROR_TIMED_OUT`` after ``timeout_ms`` (at most ``MAX_VERSION_WAIT_MS``; nil: that much), or
    ``CUCTXD_ERROR_SHUTTING_DOWN`` once the daemon drains. At most
    ``MAX_VERSION_WAITERS`` of a session wait on a device at a time. Result: ``version``."""

    name: str = name_field()
    after: int = count_field(default=0)
    timeout_ms: int | None = count_field(default=None, maximum=MAX_VERSION_WAIT_MS)
    device: int | None = count_field(default=None)


@op("verify_shared", target="device")
class VerifyShared:
    """Before relying on the layout digest ``digest`` of the name ``name`` (on device ``device``, as its
    ``lookup`` says): the daemon vouches for it. Another uid's digest is hashed from the device memory once,
    on the first reliance (later ones, and a reliance while it runs, wait for that one result), in chunks so
    that the device serves others meanwhile; a digest of the caller's own uid is trusted as it stands.
    Result: ``digest``, ``verified`` (``"publisher"``: the caller's own uid published it; ``"daemon"``: the
    daemon hashed the bytes) and ``hashed`` (whether this request waited for the hashing). A name that holds
    another digest, or whose bytes differ from it, fails with ``CUCTXD_ERROR_DIGEST_MISMATCH``
    (PROTOCOL.md, section 9, "Digests")."""

    name: str = name_field()
    digest: str = dataclasses.field(metadata={"max_len": 64})
    device: int | None = count_field(default=None)


@op("list_shared", target="front")
class ListShared:
    """One page of the published names, in code point order: at most ``limit``, those after the name
    ``after`` (the last page's ``next``), starting with ``prefix``, published by the session ``owner``
    (public id) and by ``uid``. Result: ``shared`` (list of maps: name, share_id, device, size, owner,
    owner_present, holders, publisher, tensors, read_only, digest, verified, version, copies: one map per
    device that holds a copy: device, uuid, share_id, size, holders, owner_present), ``next`` (the name to pass as
    ``after`` for the next page; nil on the last), ``count`` (names published daemon-wide), ``truncated``
    (``next`` is not nil)."""

    limit: int = count_field(default=MAX_LISTED, minimum=1, maximum=MAX_LISTED)
    after: str | None = name_field(default=None)
    prefix: str = name_field(default="")
    owner: int | None = count_field(default=None)
    uid: int | None = count_field(default=None, maximum=0xFFFF_FFFF)


@op("open_shared", target="device")
class OpenShared:
    """Hold a share open for this session so the daemon keeps it alive; the client maps it
    as the descriptor's ``mechanism`` says. ``pool_fd``: also hand over the share's fd: its
    pool's (a ``"pool"`` share, when this process has not imported that pool yet) or its
    allocation's (a ``"vmm"`` share this process does not map yet). Result: ``share``, and
    ``ticket`` (redeem it on the fd channel) when ``pool_fd`` and the share has an fd."""

    share_id: str = dataclasses.field(metadata={"max_len": 64})
    device: int | None = count_field(default=None)
    pool_fd: bool = False


@op("close_shared", target="device")
class CloseShared:
    """Drop this session's hold on a share. Result: ``{}``."""

    share_id: str = dataclasses.field(metadata={"max_len": 64})
    device: int | None = count_field(default=None)


@op("revoke", target="device")
class Revoke:
    """Withdraw a share this session exported: its names go, new opens are refused, every
    holder's hold is dropped and its next ``open_shared``/``close_shared`` of it answers
    ``CUCTXD_ERROR_REVOKED``; the memory is freed once the owner frees the buffer. Result: ``{}``."""

    share_id: str = dataclasses.field(metadata={"max_len": 64})
    device: int | None = count_field(default=None)
