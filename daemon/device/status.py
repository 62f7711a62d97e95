"""A device's part of ``status``, read on its worker thread from its :class:`DeviceState`; and the caps
that keep the whole ``status`` reply under ``MAX_HEADER_BYTES`` however many objects clients make."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeVar

from cuctxd.daemon.device.state import DeviceState
from cuctxd.protos.errors import CuctxError
from cuctxd.protos.limits import MAX_HEADER_BYTES, MAX_LISTED
from cuctxd.protos.messages import pack

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Arrays of the status map that grow with what clients make; :func:`fit_status` shortens only these.
LISTED_FIELDS = frozenset({"sessions", "contexts", "shares", "holders", "names"})
#: How many uids a device's ``orphaned`` lists by their bytes.
_TOP_UIDS = 8
#: Room left in the header for the envelope (``id``, ``ok``) around the status map.
_ENVELOPE_BYTES = 64


def first(items: Iterable[T], limit: int = MAX_LISTED) -> list[T]:
    """At most ``limit`` of ``items``, in order, without walking past them."""
    return list(itertools.islice(items, limit))


def memory_status(state: DeviceState, live: list[Any] | None = None) -> dict[str, Any]:
    """The device's memory: ``total``; ``free`` and ``used`` as the driver's ``cuMemGetInfo`` says (the whole
    device, every process), None while the daemon has no context there (making one just to ask would cost
    device memory); ``allocated``: what cuctxd holds there (its sessions' buffers, the shares their owners
    left, and the spares of versioned names). Worker thread."""
    contexts = state.live_contexts() if live is None else live
    allocated = sum(s.bytes_allocated for s in state.sessions.values()) + sum(
        share.footprint for share in state.sharing.shares.values() if not share.owner_present
    ) + state.sharing.spares.status()["bytes"]
    memory: dict[str, Any] = {"total": state.info.total_memory, "free": None, "used": None, "allocated": allocated}
    if contexts:
        try:
            state.activate(contexts[0])
            free, total = state.driver.mem_get_info()
        except CuctxError as exc:
            log.debug("device %d: no memory info: %s", state.device, exc)
        else:
            memory.update(total=total, free=free, used=total - free)
    return memory


def device_status(state: DeviceState) -> dict[str, Any]:
    """Worker, primary context, contexts, per-session memory and shares; never tokens or full share ids.

    Each array lists at most ``MAX_LISTED`` entries; ``context_count``, ``session_count`` and
    ``share_count`` give the full numbers, ``truncated`` says whether any array was cut.
    """
    flags, active = state.driver.primary_ctx_state(state.device)
    thread = state.worker_thread or threading.current_thread()
    live = state.live_contexts()
    shown = first(live)
    shown_ids = {context.context_id for context in shown}
    by_context: dict[int, list[int]] = {}
    for session in state.sessions.values():
        for context in session.contexts.values():
            if context.context_id in shown_ids:
                by_context.setdefault(context.context_id, []).append(session.ref.public_id)
    contexts = [
        {
            "context_id": context.context_id,
            "is_primary": context.is_primary,
            "flags": context.flags,
            "sessions": first(sorted(by_context.get(context.context_id, []))),
            "orphaned": context.context_id in state.contexts.orphans,
        }
        for context in shown
    ]
    shown_shares = first(state.sharing.shares.values())
    public = {s.ref.token: s.ref.public_id for s in state.sessions.values()}
    shares = [
        {
            "share_id": share.share_id[:8],  # a prefix only: the full id is what opens it
            "size": share.descriptor.size,
            "names": first(share.names),
            "owner": share.owner.public_id,
            "owner_present": share.owner_present,
            "holders": first(sorted(public.get(token, -1) for token in share.holders)),
            "revoked": share.revoked,
        }
        for share in shown_shares
    ]
    sessions = [
        {
            "session": s.ref.public_id,
            "contexts": len(s.contexts),
            "stack_depth": len(s.stack),
            "allocations": len(s.buffers),
            "bytes": s.bytes_allocated,
            "holds": sum(s.holds.values()),
            "held_bytes": s.bytes_held,
            "quota": state.limits.session_quota or None,
            "exports": s.exports,
            "created_contexts": s.created_contexts(),
            "objects": s.object_count(),
            "shares": s.share_count(),
            "host_buffers": len(s.host_buffers),
            "host_bytes": s.host_bytes,
        }
        for s in first(state.sessions.values())
    ]
    truncated = (len(live) > len(shown) or len(state.sessions) > len(sessions)
                 or len(state.sharing.shares) > len(shares)
                 or any(len(ids) > MAX_LISTED for ids in by_context.values())
                 or any(len(share.names) > MAX_LISTED or len(share.holders) > MAX_LISTED for share in shown_shares))
    return {
        "device": state.device,
        "closing_sessions": len(state.closing),
        "name": state.info.name,
        "uuid": state.info.uuid,
        "failed": None if state.failure is None else f"{state.failure.name}: {state.failure.message}",
        "worker": {"name": thread.name, "native_id": thread.native_id, "alive": thread.is_alive()},
        "primary_context": {"active": bool(active), "flags": flags, "references": state.contexts.primary_refs,
                            "kept_for": state.contexts.kept_for(time.monotonic())},
        "contexts": contexts,
        "context_count": len(live),
        "sessions": sessions,
        "session_count": len(state.sessions),
        "shares": shares,
        "share_count": len(state.sharing.shares),
        "memory": memory_status(state, live),
        "host_bytes": state.host.total_bytes,
        "host_kept": {"bytes": state.host.kept.total_bytes, "buffers": len(state.host.kept.buffers)},
        "pools": {"count": len(state.pools), "ipc": state.pools.ipc},
        "vmm": {"supported": state.memory.vmm_memory.supported, "buffers": len(state.memory.vmm_memory.sizes)},
        "shm_lanes": len(state.shm_lanes),
        "orphaned": orphaned_status(state),
        "spares": state.sharing.spares.status(),
        "digest_checks": state.digest_checks.status(),
        "version_waiters": sum(session.version_waiters for session in state.sessions.values()),
        "truncated": truncated,
        "limits": {
            "max_objects_per_session": state.limits.max_objects_per_session,
            "max_contexts_per_session": state.limits.max_contexts_per_session,
            "max_shares_per_session": state.limits.max_shares_per_session,
            "host_memory_per_session": state.limits.host_memory_per_session,
            "max_host_memory": state.limits.max_host_memory,
            "max_orphaned_bytes_per_uid": state.sharing.orphan_bytes_limit,
        },
    }


def orphaned_status(state: DeviceState) -> dict[str, Any]:
    """The device's published shares kept alive by their names alone, and their bytes by owner uid (the
    ``_TOP_UIDS`` holding the most; ``max_orphaned_bytes_per_uid``)."""
    by_uid = state.sharing.orphaned_bytes
    top = sorted(by_uid.items(), key=lambda item: -item[1])[:_TOP_UIDS]
    return {"count": len(state.sharing.orphaned), "bytes": sum(by_uid.values()),
            "top_uids": [{"uid": uid, "bytes": size} for uid, size in top]}


def fit_status(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` with its listed arrays (:data:`LISTED_FIELDS`) shortened until its reply header fits in
    ``MAX_HEADER_BYTES``, halving the longest allowed length each round. Every map with a ``truncated``
    field (the status map, each device's part) has it set if an array inside it was cut; the counts next
    to the arrays are left as they are. Any thread (it only reads and copies plain data)."""
    limit = MAX_LISTED
    while len(pack(status)) > MAX_HEADER_BYTES - _ENVELOPE_BYTES and limit > 1:
        limit //= 2
        status, _ = _shortened(status, limit)
    return status


def _shortened(value: Any, limit: int) -> tuple[Any, bool]:
    """A copy of ``value`` whose listed arrays hold at most ``limit`` entries, and whether any was cut."""
    if isinstance(value, list):
        items = [_shortened(item, limit) for item in value]
        return [item for item, _ in items], any(cut for _, cut in items)
    if not isinstance(value, dict):
        return value, False
    out: dict[str, Any] = {}
    cut_inside = False
    for key, item in value.items():
        if key in LISTED_FIELDS and isinstance(item, list) and len(item) > limit:
            item, cut_inside = item[:limit], True
        out[key], cut = _shortened(item, limit)
        cut_inside = cut_inside or cut
    if "truncated" in out:
        out["truncated"] = bool(out["truncated"]) or cut_inside
    return out, cut_inside
