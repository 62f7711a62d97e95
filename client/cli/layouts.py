"""``cuctx inspect NAME``: one layout's tensors (dtype, shape, offset, bytes), its digest, its copies and who holds
each, as one map (``--json``) or a table. Which thread may call: the CLI's (one client, one command)."""

from __future__ import annotations

from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.protos.errors import NotFound
from cuctxd.protos.layouts import check_manifest
from cuctxd.protos.sizes import human_size


def inspect_layout(client: Client, name: str) -> dict[str, Any]:
    """What ``cuctx inspect`` shows of ``name``: :class:`NotFound` for a name not published, or not a layout."""
    descriptor = client.lookup(name)
    if not descriptor.manifest:
        raise NotFound(f"{name!r} is a published buffer, not a layout of tensors (cuctx shared lists it)")
    manifest = check_manifest(descriptor.manifest, descriptor.size)
    listed = next((entry for entry in client.list_shared(prefix=name) if entry["name"] == name), {})
    holders = _holders_by_device(client.status(), name)
    copies = [{"device": copy["device"], "uuid": copy["uuid"], "size": copy["size"],
               "holders": holders.get(copy["device"], [])} for copy in listed.get("copies", [])]
    return {"name": name, "size": descriptor.size, "digest": manifest.digest, "verified": listed.get("verified"),
            "read_only": descriptor.read_only, "publisher": descriptor.publisher, "metadata": manifest.metadata,
            "tensors": [{"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape), "offset": spec.offset,
                         "nbytes": spec.nbytes} for spec in manifest.tensors],
            "copies": copies}


def _holders_by_device(status: dict[str, Any], name: str) -> dict[int, list[int]]:
    """The sessions holding (having opened) ``name``'s copy on each device, from a status map."""
    return {device["device"]: [holder for share in device.get("shares", []) if name in share.get("names", [])
                               for holder in share.get("holders", [])]
            for device in status.get("devices", [])}


def inspect_text(layout: dict[str, Any]) -> str:
    """:func:`inspect_layout` as a header, a table of tensors, and a line per copy."""
    lines = [f"{layout['name']}: {len(layout['tensors'])} tensors, {human_size(layout['size'])}, digest "
             f"{layout['digest'] or '-'}" + (" (read-only)" if layout["read_only"] else "")]
    rows = [("TENSOR", "DTYPE", "SHAPE", "OFFSET", "BYTES")] + [
        (t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", str(t["offset"]), str(t["nbytes"]))
        for t in layout["tensors"]]
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines += ["  ".join(cell.ljust(width) if column < 3 else cell.rjust(width)
                        for column, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip()
              for row in rows]
    for copy in layout["copies"]:
        held = f"session(s) {', '.join(map(str, copy['holders']))}" if copy["holders"] else "nobody"
        lines.append(f"copy on device {copy['device']} ({copy['uuid']}): held by {held}")
    return "\n".join(lines)
