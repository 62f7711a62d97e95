"""``cuctx doctor``: can this process use cuctxd? One PASS/WARN/FAIL line per check.

Checks, in order: the CUDA driver here (needed to map cuda shares), the devices
it sees, the ipc:// socket and its directory's permissions, that the daemon
answers, that it speaks our protocol, and that buffers can be shared between
this process and the daemon (same host and boot, and a real mapping of an
exported buffer). A check that cannot run because an earlier one failed says
so as a WARN. Any FAIL makes ``cuctx doctor`` exit 1.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.cli.tables import human_duration
from cuctxd.client.wire import build
from cuctxd.client.wire.socket_transport import CurveKeys, Transport
from cuctxd.client.wire.transport import access_problem
from cuctxd.protos.errors import CuctxError, VersionMismatch
from cuctxd.protos.host import host_identity
from cuctxd.protos.version import PROTOCOL_VERSION

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_PATTERN = b"cuctx doctor\x00\xff"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str

    def to_wire(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "detail": self.detail}


def run_checks(endpoint: str, timeout: float, curve: CurveKeys | None = None) -> list[Check]:
    """Every check against ``endpoint``; ``curve``: the keys for a daemon with server_key, as ``ping`` uses."""
    return list(_checks(endpoint, timeout, curve))


def _checks(endpoint: str, timeout: float, curve: CurveKeys | None) -> Iterator[Check]:
    yield from _driver_checks()
    denied = access_problem(endpoint)
    if denied is not None:  # a daemon may well be running: say what stops this user, and wait for nothing
        yield Check("socket", FAIL, denied)
        yield Check("daemon", WARN, "not checked: this user may not connect to the socket (above)")
        for name in ("protocol", "ipc"):
            yield Check(name, WARN, "not checked: the daemon is not reachable")
        return
    yield _socket_check(endpoint)
    reachable = _reachable_check(endpoint, timeout, curve)
    yield reachable
    if reachable.status == FAIL:
        for name in ("protocol", "ipc"):
            yield Check(name, WARN, "not checked: the daemon is not reachable")
        return
    try:
        client = Client(endpoint, timeout=timeout, hello_timeout=timeout, name="cuctx-doctor", heartbeat=False,
                        server_key=curve)
    except VersionMismatch as exc:
        yield Check("protocol", FAIL, f"{exc.message} (this client speaks protocol {PROTOCOL_VERSION})")
        yield Check("ipc", WARN, "not checked: no session with the daemon")
        return
    except CuctxError as exc:
        yield Check("protocol", FAIL, f"hello failed: {exc}")
        yield Check("ipc", WARN, "not checked: no session with the daemon")
        return
    with client:
        detail = f"protocol {client.protocol}, cuctxd {client.daemon_version}, backend {client.backend}"
        ours = _installed_version()
        if ours is not None and ours != client.daemon_version:
            yield Check("protocol", WARN, f"{detail}; this client is cuctxd {ours} (same protocol, other release)")
        else:
            yield Check("protocol", PASS, detail)
        yield _ipc_check(client)


def _installed_version() -> str | None:
    """This client's package version when installed (not when run from a source tree)."""
    try:
        return importlib.metadata.version("cuctxd")
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_checks() -> Iterator[Check]:
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
    except (ImportError, RuntimeError, OSError) as exc:
        yield Check("driver", WARN, f"no CUDA driver in this process ({exc}); only the sim backend "
                                    "can serve it, and cuda shares cannot be mapped here")
        yield Check("devices", WARN, "not checked: no CUDA driver")
        return
    if err != cu.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        status = WARN if name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NOT_INITIALIZED") else FAIL
        yield Check("driver", status, f"cuInit failed: {name}")
        yield Check("devices", WARN, "not checked: cuInit failed")
        return
    _, version = cu.cuDriverGetVersion()
    yield Check("driver", PASS, f"CUDA driver {version // 1000}.{version % 1000 // 10}")
    _, count = cu.cuDeviceGetCount()
    if count:
        yield Check("devices", PASS, f"{count} device(s) visible to this process")
    else:
        yield Check("devices", WARN, "the driver sees no device (CUDA_VISIBLE_DEVICES?)")


def _socket_check(endpoint: str) -> Check:
    if not endpoint.startswith("ipc://"):
        return Check("socket", PASS, f"{endpoint}: not an ipc:// endpoint, no socket file to check")
    path = Path(endpoint[len("ipc://"):])
    directory = path.parent
    try:
        info = directory.stat()
    except OSError as exc:
        return Check("socket", FAIL, f"{directory}: {exc.strerror}; is cuctxd running with this endpoint?")
    mode = stat.S_IMODE(info.st_mode)
    notes = []
    status = PASS
    if info.st_uid != os.getuid():
        status = WARN
        notes.append(f"owned by uid {info.st_uid}, not by you (uid {os.getuid()}): trust that daemon?")
    if mode & 0o007:
        status = WARN
        notes.append("other users can enter it (expected 0700, or 0770 for a group)")
    try:
        sock = path.stat()
    except OSError as exc:
        return Check("socket", FAIL, f"{path}: {exc.strerror}; is cuctxd running with this endpoint?")
    if not stat.S_ISSOCK(sock.st_mode):
        return Check("socket", FAIL, f"{path} exists but is not a socket")
    if not os.access(path, os.R_OK | os.W_OK):
        return Check("socket", FAIL, f"{path}: no permission to connect (mode {stat.S_IMODE(sock.st_mode):04o})")
    detail = f"{path} (directory {mode:04o}, socket {stat.S_IMODE(sock.st_mode):04o})"
    return Check("socket", status, "; ".join([detail, *notes]))


def _reachable_check(endpoint: str, timeout: float, curve: CurveKeys | None) -> Check:
    transport = Transport(endpoint, timeout, curve)
    try:
        start = time.perf_counter()
        ping = build.ping()
        transport.call(ping.op, ping.args, None)
        rtt = time.perf_counter() - start
    except CuctxError as exc:
        return Check("daemon", FAIL, f"no answer from {endpoint}: {exc}")
    finally:
        transport.close()
    return Check("daemon", PASS, f"{endpoint} answers ping in {human_duration(rtt)}")


def _ipc_check(client: Client) -> Check:
    """Export a small buffer and map it here: the real thing a sharing program does."""
    if client.device_count() == 0:
        return Check("ipc", WARN, "not checked: the daemon serves no device")
    backend = client.backend
    try:
        buffer = client.alloc(4096, device=0, shareable=True)
    except CuctxError as exc:
        return Check("ipc", FAIL, f"cannot allocate a test buffer on device 0: {exc}")
    try:
        descriptor = client.export(buffer)
        here = host_identity()
        if descriptor.host != here:
            return Check("ipc", FAIL, f"the daemon runs on {descriptor.host}, this process on {here}: "
                                      "shared buffers cannot be mapped across hosts (or reboots)")
        with client.open_shared(descriptor) as opened:
            detail = _round_trip(client, buffer, opened, backend)
    except CuctxError as exc:
        return Check("ipc", FAIL, f"{backend} backend: exporting and mapping a buffer failed: {exc}")
    finally:
        with contextlib.suppress(CuctxError):  # if not, it goes with the session
            buffer.free()
    return Check("ipc", PASS, f"{backend} backend, same host: {detail}")


def _round_trip(client: Client, buffer: Any, mapping: Any, backend: str) -> str:
    how = "its pool imported over the fd channel" if mapping.descriptor.mechanism == "pool" else "a legacy IPC handle"
    if backend != "sim":
        return f"an exported buffer maps into this process ({how})"
    view = mapping.host_view()
    view[: len(_PATTERN)] = _PATTERN
    if buffer.read(len(_PATTERN)) != _PATTERN:
        raise _Mismatch()
    return f"an exported buffer maps into this process ({how}) and shows the same bytes"


class _Mismatch(CuctxError):
    def __init__(self) -> None:
        super().__init__(0, "CUCTX_DOCTOR_MISMATCH", "bytes written through the mapping did not read back")
