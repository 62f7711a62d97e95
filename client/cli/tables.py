"""Readable tables for the ``cuctx`` CLI; ``--json`` bypasses all of this."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cuctxd.protos import digests
from cuctxd.protos.records import DeviceInfo
from cuctxd.protos.sizes import human_size


def human_duration(seconds: float) -> str:
    """``0.0939`` -> ``"93.9 ms"``: µs below a millisecond, ms below a second, else s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def devices_table(devices: Sequence[DeviceInfo], memory: Mapping[int, dict[str, Any]] | None = None) -> str:
    """One row per device; ``memory``: each device's ``memory`` from ``status`` (USED and FREE are the
    driver's, the whole device; "-" until the daemon has a context there)."""
    memory = memory or {}
    return table(
        ["DEV", "NAME", "CC", "MEMORY", "USED", "FREE", "CUCTXD", "SMS", "PCI BUS ID", "UUID"],
        [
            [d.index, d.name, "{}.{}".format(*d.compute_capability), human_size(d.total_memory),
             *_memory_cells(memory.get(d.index)), d.multiprocessor_count, d.pci_bus_id, d.uuid]
            for d in devices
        ],
    )


def _memory_cells(memory: dict[str, Any] | None) -> list[str]:
    """USED, FREE and CUCTXD (what the daemon holds) of a device's ``memory``."""
    if memory is None:
        return ["-", "-", "-"]
    return [_size_or_dash(memory.get("used")), _size_or_dash(memory.get("free")),
            _size_or_dash(memory.get("allocated"))]


def _size_or_dash(size: int | None) -> str:
    return "-" if size is None else human_size(size)


def memory_line(memory: dict[str, Any]) -> str:
    """A device's memory in ``cuctx status``."""
    held = f"cuctxd holds {human_size(memory['allocated'])}"
    if memory.get("free") is None:
        return f"  memory: {human_size(memory['total'])}; {held}; used/free: not known until a context lives there"
    return (f"  memory: {human_size(memory['used'])} used, {human_size(memory['free'])} free of "
            f"{human_size(memory['total'])} (whole device); {held}")


def status_text(status: dict[str, Any], own_session: int | None = None) -> str:
    """``cuctx status``; ``own_session``: the session of the cuctx asking, marked ``(this cuctx)``."""
    lines = [
        f"cuctxd {status['daemon_version']} (protocol {status['protocol']}), backend {status['backend']}, "
        f"pid {status['pid']}, up {status['uptime_s']:.0f} s",
        f"listening on {', '.join(status['endpoints'])}",
        *_connections_line(status),
        *_fd_channel_line(status),
        *_parking_line(status),
        *_ordinals_line(status),
        "",
        f"sessions: {len(status['sessions'])}",
    ]
    if status["sessions"]:
        lines.append(table(
            ["SESSION", "CLIENT", "PID", "DEVICE"],
            [[s["session"], f"{s['client']} (this cuctx)" if s["session"] == own_session else s["client"], s["pid"],
              s["current_device"]] for s in status["sessions"]],
        ))
    for dev in status["devices"]:
        if "error" in dev:
            lines += ["", f"device {dev['device']}: status unavailable: {dev['error']}"]
            continue
        worker, primary = dev["worker"], dev["primary_context"]
        lines += [
            "",
            f"device {dev['device']} {dev['name']}: worker {worker['name']} (tid {worker['native_id']}, "
            f"{'alive' if worker['alive'] else 'DEAD'}); primary context "
            f"{'active' if primary['active'] else 'inactive'}, {primary['references']} reference(s)"
            + (f", kept {primary['kept_for']:.0f} s more" if primary.get("kept_for") is not None else ""),
        ]
        if dev.get("memory"):
            lines.append(memory_line(dev["memory"]))
        if dev.get("failed"):
            lines.append(f"  FAILED: {dev['failed']} (this device refuses all work until the daemon restarts)")
        if dev.get("shm_lanes"):
            lines.append(f"  shm lanes: {dev['shm_lanes']} open")
        kept = dev.get("host_kept") or {}
        if kept.get("buffers"):
            lines.append(f"  host buffers kept page-locked for reuse: {kept['buffers']}, {human_size(kept['bytes'])}")
        if dev["contexts"]:
            lines.append(table(
                ["CONTEXT", "KIND", "FLAGS", "SESSIONS"],
                [[c["context_id"], "primary" if c["is_primary"] else "created", c["flags"],
                  ",".join(map(str, c["sessions"]))] for c in dev["contexts"]],
            ))
        if dev["sessions"]:
            lines.append(_sessions_table(dev))
        if dev.get("queues"):
            limits = status.get("limits", {})
            lines.append(table(
                ["SESSION", "QUEUED", "QUEUED BYTES", "UNREAD REPLIES"],
                [[q["session"], _of(q["queued"], limits.get("max_queued_requests")),
                  _of(q["queued_bytes"], limits.get("max_queued_bytes"), human_size),
                  _of(q["reply_bytes"], limits.get("max_reply_bytes"), human_size)] for q in dev["queues"]],
            ))
        if dev["shares"]:
            lines.append(table(
                ["SHARE", "SIZE", "NAMES", "OWNER", "HOLDERS"],
                [[sh["share_id"][:12], human_size(sh["size"]), ",".join(sh["names"]) or "-",
                  sh["owner"] if sh["owner_present"] else f"{sh['owner']} (gone)",
                  ",".join(map(str, sh["holders"])) or "-"] for sh in dev["shares"]],
            ))
    return "\n".join(lines)


def _sessions_table(dev: dict[str, Any]) -> str:
    """Each session's use of the device, against the per-session limits where the daemon says them
    (CREATED: contexts it created, the primary not counted; OBJECTS and SHARES as the limits count)."""
    limits = dev.get("limits", {})
    return table(
        ["SESSION", "CONTEXTS", "CREATED", "STACK", "ALLOCATIONS", "OBJECTS", "BYTES", "HOLDS", "HELD", "SHARES",
         "HOST", "QUOTA"],
        [[s["session"], s["contexts"], _of(s.get("created_contexts", 0), limits.get("max_contexts_per_session")),
          s["stack_depth"], s["allocations"], _of(s.get("objects", 0), limits.get("max_objects_per_session")),
          human_size(s["bytes"]), s["holds"], human_size(s.get("held_bytes", 0)),
          _of(s.get("shares", 0), limits.get("max_shares_per_session")),
          _of(s.get("host_bytes", 0), limits.get("host_memory_per_session"), human_size),
          human_size(s["quota"]) if s.get("quota") else "-"] for s in dev["sessions"]],
    )


def _of(used: int, limit: int | None, show: Any = str) -> str:
    """``used/limit`` (``used`` alone without a limit)."""
    return f"{show(used)}/{show(limit)}" if limit else show(used)


def _connections_line(status: dict[str, Any]) -> list[str]:
    """Client connections against ``max_connections`` (daemons before it do not say)."""
    seen = status.get("connections")
    if seen is None:
        return []
    refusing = "" if seen["accepting"] else " (at the limit: new connections refused)"
    return [f"connections: {seen['open']} of {seen['max']}{refusing}"]


def _fd_channel_line(status: dict[str, Any]) -> list[str]:
    """The fd channel's connections and the tickets waiting on it (absent without an ipc:// endpoint)."""
    channel = status.get("fd_channel")
    if channel is None:
        return []
    return [f"fd channel: {channel['connections']} of {channel['max_connections']} connections, "
            f"{channel['tickets']} ticket(s) waiting ({channel['fds']} fds)"]


def _parking_line(status: dict[str, Any]) -> list[str]:
    """The service manager's fd store: its fds that parked shares hold, in all and per uid (absent without one)."""
    parking = status.get("parking")
    if parking is None:
        return []
    uids = ", ".join(f"uid {u['uid']}: {_of(u['fds'], parking['max_per_uid'])}" for u in parking["uids"])
    refused = f"; {parking['refused']} persistent publish(es) refused" if parking["refused"] else ""
    return [f"parked: {parking['shares']} share(s), {_of(parking['fds'], parking['store_max'])} fds of the service "
            f"manager's fd store{f' ({uids})' if uids else ''}{refused}"]


def _ordinals_line(status: dict[str, Any]) -> list[str]:
    """Which driver ordinal each device is, when the daemon serves a subset (``--devices``)."""
    ordinals = status.get("device_ordinals")
    if not ordinals or list(ordinals) == list(range(len(ordinals))):
        return []
    return ["driver ordinals: " + ", ".join(f"device {i} = {o}" for i, o in enumerate(ordinals))]


def shared_table(shared: Sequence[dict[str, Any]]) -> str:
    if not shared:
        return "no published buffers"
    return table(
        ["NAME", "DEVICE", "SIZE", "TENSORS", "MODE", "OWNER", "PUBLISHER", "HOLDERS", "DIGEST", "SHARE"],
        [[_named(s), _device(copy), human_size(copy["size"]), s.get("tensors") or "-",
          "ro" if s.get("read_only") else "rw", s["owner"] if s["owner_present"] else f"{s['owner']} (gone)",
          _publisher(s.get("publisher")), copy["holders"], _digest(s), copy["share_id"]]
         for s in shared for copy in _copies(s)],
    )


def _copies(shared: dict[str, Any]) -> list[dict[str, Any]]:
    """A name's copies, one row each (a daemon before copies lists the name's one share)."""
    return shared.get("copies") or [shared]


def _device(copy: dict[str, Any]) -> str:
    """A copy's device and the start of its UUID (ordinals differ between processes, UUIDs do not)."""
    uuid = copy.get("uuid")
    return str(copy["device"]) if not uuid else f"{copy['device']} {uuid[:12]}"


def _named(shared: dict[str, Any]) -> str:
    """A name, with its current version's number where it has versions."""
    return f"{shared['name']} v{shared['version']}" if shared.get("version") else str(shared["name"])


#: What the DIGEST column adds where the daemon hashed the bytes (``list_shared``'s ``verified``).
_VERIFIED = {"daemon": " verified", "mismatch": " MISMATCH"}


def _digest(shared: dict[str, Any]) -> str:
    """A name's short digest, and whether the daemon found its bytes bear it out (else: its publisher's word)."""
    if not shared.get("digest"):
        return "-"
    return digests.short(shared["digest"]) + _VERIFIED.get(shared.get("verified") or "", "")


def _publisher(publisher: dict[str, Any] | None) -> str:
    """``client pid N uid U`` of whoever published a name (what the daemon knows of it)."""
    if not publisher:
        return "-"
    uid = publisher.get("uid")
    return f"{publisher.get('client')} pid {publisher.get('pid')}" + ("" if uid is None else f" uid {uid}")


#: ANSI: cursor home, clear screen (what ``top`` and ``watch`` do between frames).
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def watch_frame(body: str, endpoint: str, interval: float, when: str, *, clear: bool) -> str:
    """One refresh of ``cuctx status --watch``: a header line and the body. ``clear`` (on a terminal):
    clear the screen first; else (a pipe or a file) frames follow one another, a blank line apart."""
    frame = f"every {interval:g} s: {endpoint}  {when}  (Ctrl-C to quit)\n\n{body}\n"
    return CLEAR_SCREEN + frame if clear else frame + "\n"


def doctor_text(checks: Sequence[Any]) -> str:
    """``STATUS  check: detail`` lines, then a summary."""
    lines = [f"{c.status}  {c.name}: {c.detail}" for c in checks]
    failed = sum(c.status == "FAIL" for c in checks)
    warned = sum(c.status == "WARN" for c in checks)
    lines.append("")
    lines.append(f"{failed} failed, {warned} warning(s)" if failed or warned else "all checks passed")
    return "\n".join(lines)
