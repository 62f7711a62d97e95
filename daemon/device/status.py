"""A device's part of ``status``, read on its worker thread from its :class:`DeviceState`."""

from __future__ import annotations

import threading
from typing import Any

from cuctxd.daemon.device.state import DeviceState


def device_status(state: DeviceState) -> dict[str, Any]:
    """Worker, primary context, contexts, per-session memory and shares; never tokens or full share ids."""
    flags, active = state.driver.primary_ctx_state(state.device)
    thread = state.worker_thread or threading.current_thread()
    by_context: dict[int, list[int]] = {}
    for session in state.sessions.values():
        for context in session.contexts.values():
            by_context.setdefault(context.context_id, []).append(session.ref.public_id)
    contexts = [
        {
            "context_id": context.context_id,
            "is_primary": context.is_primary,
            "flags": context.flags,
            "sessions": sorted(by_context.get(context.context_id, [])),
            "orphaned": context.context_id in state.contexts.orphans,
        }
        for context in state.live_contexts()
    ]
    public = {s.ref.token: s.ref.public_id for s in state.sessions.values()}
    return {
        "device": state.device,
        "closing_sessions": len(state.closing),
        "name": state.info.name,
        "failed": None if state.failure is None else f"{state.failure.name}: {state.failure.message}",
        "worker": {"name": thread.name, "native_id": thread.native_id, "alive": thread.is_alive()},
        "primary_context": {"active": bool(active), "flags": flags, "references": state.contexts.primary_refs},
        "contexts": contexts,
        "sessions": [
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
            }
            for s in state.sessions.values()
        ],
        "shares": [
            {
                "share_id": share.share_id[:8],  # a prefix only: the full id is what opens it
                "size": share.descriptor.size,
                "names": sorted(share.names),
                "owner": share.owner.public_id,
                "owner_present": share.owner_present,
                "holders": sorted(public.get(token, -1) for token in share.holders),
                "revoked": share.revoked,
            }
            for share in state.sharing.shares.values()
        ],
    }
