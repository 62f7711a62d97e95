"""Sharing ops: export/publish/open/close run on the share's device worker; names and
leases are answered by the front from the daemon-wide :class:`~cuctxd.daemon.registry.shares.ShareRegistry`."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from cuctxd.daemon.device.entries import SessionContext
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.handlers.registry import device_handler, front_handler
from cuctxd.daemon.handlers.replies import Forward, Pending, Reply, after_markers
from cuctxd.daemon.intake.jobs import Job
from cuctxd.daemon.registry.daemon_state import DaemonState
from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.sessions import Session
from cuctxd.protos import sharing_ops as ops
from cuctxd.protos.errors import BadArgument, LimitExceeded, NotParked, ShuttingDown, TimedOut
from cuctxd.protos.layouts import Manifest, check_manifest
from cuctxd.protos.limits import MAX_HEADER_BYTES, MAX_VERSION_WAIT_MS, MAX_VERSION_WAITERS
from cuctxd.protos.messages import pack

#: Room in a ``list_shared`` reply header for all but its records: the envelope, ``next`` (a name of at most
#: 256 characters), ``count``, ``truncated``.
_PAGE_ENVELOPE_BYTES = 4096


@functools.lru_cache(maxsize=4)
def _checked_manifest(raw: bytes, size: int) -> Manifest:
    """:func:`check_manifest`, once per manifest and buffer size while it is among the last few: each version of a
    name carries the same manifest (about 1.5 ms to check for 300 tensors). Any worker thread."""
    return check_manifest(raw, size)


def _share_reply(descriptor_wire: dict[str, object]) -> Reply:
    return Reply({"share": descriptor_wire})


def _when_written(state: DeviceState, context: SessionContext, reply: Reply) -> Reply | Pending:
    """``reply`` once the work queued so far on the buffer context's legacy stream (its stream-ordered
    allocation, writes) has passed, so an opener in another process sees the bytes the owner wrote."""
    return after_markers(state.streams, [state.streams.marker_on(context, None)], reply)


@device_handler(ops.Export)
def export(state: DeviceState, job: Job[ops.Export]) -> Reply | Pending:
    session = state.session(job.session)
    share = state.sharing.export(session, session.buffers[job.args.buffer])
    return _when_written(state, share.context, _share_reply(share.descriptor.to_wire()))


@device_handler(ops.Publish)
def publish(state: DeviceState, job: Job[ops.Publish]) -> Reply | Pending | Forward:
    """Name the buffer (or, ``copy``/``stage``, make it a copy of the name on this device); with ``replace``,
    the name's old shares (its copies on other devices too) forget it each on its own device's worker (here,
    or forwarded there, one device after the other, and back) before the reply, as after ``unpublish``. A
    ``persistent`` name is parked (PROTOCOL.md, "Parking") before the reply, or the publish fails with
    ``NotParked`` and names nothing on this device. A ``version`` is persistent and handed to its name: the
    session lets go of the buffer as a ``free`` that keeps its names."""
    name = job.args.name
    if not name:
        raise BadArgument("publish needs a non-empty name")
    if job.args.once and (job.args.persistent or job.args.version):
        raise BadArgument("a name published once (consume-once) cannot be persistent or versioned")
    if job.args.version and (job.args.copy or job.args.stage):
        raise BadArgument("a version of a name has no copies on other devices: publish it without copy or stage")
    if (job.args.copy or job.args.stage) and (job.args.once or job.args.replace):
        raise BadArgument("a copy of a name is published neither once nor with replace (replace the name itself)")
    session = state.session(job.session)
    buffer = session.buffers[job.args.buffer]
    if buffer.spare_of and (name != buffer.spare_of or not job.args.version):
        raise BadArgument(f"this buffer is {buffer.spare_of!r}'s spare (alloc with version_of), holding an older "
                          f"version of it: publish it only as {buffer.spare_of!r}'s next version (with version)")
    naming = Naming(read_only=job.args.read_only)
    if job.args.manifest is not None:  # checked before anything is exported or named
        manifest = _checked_manifest(job.args.manifest, buffer.size)
        naming = Naming(job.args.manifest, len(manifest.tensors), job.args.read_only, manifest.digest)
    state.sharing.check_orphan_room(session, buffer)
    share = state.sharing.export(session, buffer)
    persistent = share.persistent or job.args.persistent or job.args.version
    park_fd = state.parking.ready(share) if persistent else None
    try:
        replaced = state.registry.publish(name, share, naming, replace=job.args.replace, copy=job.args.copy,
                                          stage=job.args.stage, version=job.args.version)
    except BaseException:
        if park_fd is not None:
            os.close(park_fd)
        raise
    was_persistent, share.persistent = share.persistent, persistent
    share.once = share.once or job.args.once
    for old_share, old_device in replaced:
        if old_device == state.device:
            state.sharing.forget_name(name, old_share)  # unparked (or updated) before the new share is parked
    try:
        state.parking.sync_published(share, park_fd)
    except NotParked:
        share.persistent = was_persistent
        state.registry.withdraw(name, share)
        state.sharing.forget_name(name, share.share_id)
        raise
    version = state.registry.version_of(name, share.share_id) if job.args.version else 0
    if version:
        state.find_version_digests(share)
    buffers = state.registry.buffers(name) if version else ()
    written = _when_written(state, share.context, _share_reply({**share.descriptor.to_wire(), "name": name,
                                                                "read_only": job.args.read_only, "version": version,
                                                                "buffers": buffers}))
    if job.args.version:
        state.memory.free(session, buffer, unpublish=False)  # the name keeps it now
    elsewhere = [(old_share, old_device) for old_share, old_device in replaced if old_device != state.device]
    if not elsewhere:
        return written
    here = state.device
    return _forget_each(name, elsewhere, lambda _: Forward(here, lambda _: written))


def _forget_each(name: str, left: list[tuple[str, int]],
                 last: Callable[[DeviceState], Reply | Pending | Forward]) -> Forward:
    """Each (share, device) of ``left`` in turn forgets ``name`` on its device's worker; then ``last`` runs on the
    last of them."""
    (share_id, device), rest = left[0], left[1:]

    def on_device(state: DeviceState) -> Reply | Pending | Forward:
        state.sharing.forget_name(name, share_id)
        return _forget_each(name, rest, last) if rest else last(state)

    return Forward(device, on_device)


@device_handler(ops.OpenShared)
def open_shared(state: DeviceState, job: Job[ops.OpenShared]) -> Reply:
    """Hold the share (with ``pool_fd``, its pool's or allocation's fd on the fd channel); a version's
    descriptor says its name's ``buffers``."""
    session = state.session(job.session)
    share = state.sharing.open(session, job.args.share_id)
    result: dict[str, object] = {"share": {**share.descriptor.to_wire(),
                                           "buffers": state.registry.buffers_of_share(share.share_id)}}
    mechanism = share.descriptor.mechanism
    if job.args.pool_fd and mechanism in ("pool", "vmm"):
        try:
            if mechanism == "pool":
                fd, info = state.pools.export_fd(share.ptr), {"pool_id": share.descriptor.pool_id}
            else:
                fd, info = state.memory.vmm_memory.export_fd(share.ptr, share.owner), {"share_id": share.share_id}
            result["ticket"] = state.tickets.issue(job.session.token, job.session.uid, [fd], info,
                                                   job.session.fd_peer)
        except BaseException:
            state.sharing.close(session, share.share_id)
            raise
    return Reply(result)


@device_handler(ops.WaitVersion)
def wait_version(state: DeviceState, job: Job[ops.WaitVersion]) -> Reply | Pending:
    """The name's current version once it is newer than ``after``: at once, or polled between requests (a
    registry read) until it is, the timeout passes or the session is gone."""
    session = state.session(job.session)
    name, after, registry = job.args.name, job.args.after, state.registry
    found = registry.current_version(name)
    if found > after:
        return Reply({"version": found})
    if session.version_waiters >= MAX_VERSION_WAITERS:
        raise LimitExceeded(f"MAX_VERSION_WAITERS: this session already has {session.version_waiters} "
                            f"wait_version requests waiting on device {state.device}")
    timeout_ms = MAX_VERSION_WAIT_MS if job.args.timeout_ms is None else job.args.timeout_ms
    deadline = time.monotonic() + timeout_ms / 1000
    session.version_waiters += 1
    token = job.session.token

    def done() -> bool:
        return (registry.current_version(name) > after or time.monotonic() >= deadline
                or token not in state.sessions or state.draining or state.sharing.stopping)

    def then() -> Reply:
        session.version_waiters -= 1
        found = registry.current_version(name)
        if found > after:
            return Reply({"version": found})
        if state.draining or state.sharing.stopping:
            raise ShuttingDown(f"cuctxd is shutting down: the wait for a version of {name!r} newer than {after} "
                               "ends unanswered")
        raise TimedOut(f"{name!r} has no version newer than {after} after {timeout_ms} ms "
                       f"(current: {found or 'none'})")

    return Pending(done, then)


@device_handler(ops.VerifyShared)
def verify_shared(state: DeviceState, job: Job[ops.VerifyShared]) -> Reply | Pending:
    """Vouch for a name's digest: at once where its publisher's uid is the caller's or it was checked before,
    else once its bytes are hashed (:mod:`cuctxd.daemon.device.digest_checks`), the device serving others
    meanwhile."""
    digest = job.args.digest
    found = state.digest_checks.rely(job.session, job.args.name, digest)
    if isinstance(found, str):
        return Reply({"digest": digest, "verified": found, "hashed": False})
    checks = state.digest_checks
    return Pending(lambda: checks.poll(found),
                   lambda: Reply({"digest": digest, "verified": found.outcome(digest), "hashed": True}))


@device_handler(ops.Revoke)
def revoke(state: DeviceState, job: Job[ops.Revoke]) -> Reply:
    state.sharing.revoke(state.session(job.session), job.args.share_id)
    return Reply()


@device_handler(ops.CloseShared)
def close_shared(state: DeviceState, job: Job[ops.CloseShared]) -> Reply:
    state.sharing.close(state.session(job.session), job.args.share_id)
    return Reply()


@front_handler(ops.Heartbeat)
def heartbeat(front: DaemonState, session: Session | None, args: ops.Heartbeat, peer: str | None) -> Reply:
    return Reply({"lease_ttl": front.config.lease_ttl})


@front_handler(ops.Unpublish)
def unpublish(front: DaemonState, session: Session | None, args: ops.Unpublish, peer: str | None) -> Forward:
    """The name goes here (every copy of it, or with ``device`` its copy there); each copy's share forgets it on
    its device's worker, one after the other, and the last replies once that is done (and the shares unparked,
    or their parked records updated: a restart after the reply never finds the name)."""
    assert session is not None
    left = front.shares.unpublish(args.name, session.ref, args.device)
    return _forget_each(args.name, left, lambda _: Reply())


@front_handler(ops.Lookup)
def lookup(front: DaemonState, session: Session | None, args: ops.Lookup, peer: str | None) -> Reply:
    return _share_reply(front.shares.lookup(args.name, args.device, args.version).to_wire())


@front_handler(ops.ListShared)
def list_shared(front: DaemonState, session: Session | None, args: ops.ListShared, peer: str | None) -> Reply:
    """One page: O(log n + limit) on the front however many names there are (the registry keeps them sorted,
    daemon-wide and by owner), cut shorter where its records would not fit in one reply header."""
    which = NameFilter(args.after, args.prefix, args.owner, args.uid)
    records, more, count = front.shares.page(which, args.limit)
    shared = _fitting(records, MAX_HEADER_BYTES - _PAGE_ENVELOPE_BYTES)
    last = shared[-1]["name"] if shared and (more or len(shared) < len(records)) else None
    return Reply({"shared": shared, "next": last, "count": count, "truncated": last is not None})


def _fitting(records: list[dict[str, Any]], room: int) -> list[dict[str, Any]]:
    """The first of ``records`` whose packed sizes fit in ``room`` bytes (at least one)."""
    used = 0
    for index, record in enumerate(records):
        used += len(pack(record))
        if used > room and index:
            return records[:index]
    return records
