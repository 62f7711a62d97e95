"""Checkpoints loaded at start (``preload``), so that a restarted daemon serves the same names again.

A DaemonSet rollout restarts the daemon; without this, nothing loads its models back. Each entry is
loaded by ``cuctx load`` (the client's loader: the daemon never imports the client) in a subprocess,
one after the other, on the thread ``cuctxd-preload``, which the daemon starts once its endpoints are
bound. A restarted pod's load reads the node's page cache; a name the daemon adopted back from the
service manager is found already loaded and left as it is. A missing or bad checkpoint is logged with
the loader's message and skipped; the daemon serves the rest. Until the last entry is done the
front's ``ready`` is False (``status``, and ``cuctx ping --ready``, the readiness probe).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preload:
    """One checkpoint: ``path`` (what ``cuctx load`` takes) published as ``name`` on each of ``devices``;
    with more than one device, as ``name@N`` on device N (a name is daemon-wide)."""

    name: str
    path: str
    devices: tuple[int, ...] = (0,)

    def targets(self) -> list[tuple[str, int]]:
        """``(name, device)`` of each load."""
        if len(self.devices) == 1:
            return [(self.name, self.devices[0])]
        return [(f"{self.name}@{device}", device) for device in self.devices]

    def text(self) -> str:
        """As the flag takes it: ``NAME=PATH[@D,D...]``."""
        return f"{self.name}={self.path}@{','.join(map(str, self.devices))}"


def preload_entry(value: Any) -> Preload:
    """A table ``{name, path, devices}`` (devices optional, default ``[0]``) or ``"NAME=PATH[@D,D...]"``;
    ValueError saying what is wrong."""
    if isinstance(value, str):
        value = _entry_table(value)
    if not isinstance(value, dict) or set(value) - {"name", "path", "devices"}:
        raise ValueError(f"{value!r}: expected a table of name, path and devices, or NAME=PATH[@DEVICES]")
    name, path, devices = value.get("name"), value.get("path"), value.get("devices", [0])
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ValueError(f"{value!r}: name and path must be non-empty strings")
    if (not isinstance(devices, list) or not devices
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)):
        raise ValueError(f"{value!r}: devices must be a non-empty list of device indices")
    return Preload(name, path, tuple(devices))


def _entry_table(text: str) -> dict[str, Any]:
    """``NAME=PATH[@D,D...]`` as the table it stands for."""
    name, equals, rest = text.partition("=")
    path, at, devices_text = rest.rpartition("@") if "@" in rest else (rest, "", "")
    if not equals:
        raise ValueError(f"{text!r}: expected NAME=PATH or NAME=PATH@DEVICE[,DEVICE...]")
    try:
        devices = [int(d) for d in devices_text.split(",")] if at else [0]
    except ValueError:
        raise ValueError(f"{text!r}: the devices after @ are ordinals, e.g. @0,1") from None
    return {"name": name, "path": path, "devices": devices}


def preload_list(value: Any) -> tuple[Preload, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of checkpoints")
    return tuple(item if isinstance(item, Preload) else preload_entry(item) for item in value)


def preload_texts(entries: tuple[Preload, ...]) -> list[str]:
    """For ``--print-config``."""
    return [entry.text() for entry in entries]


class Preloader:
    """Loads the entries on its own thread, then calls ``done`` (from that thread)."""

    def __init__(self, entries: tuple[Preload, ...], endpoint: str, done: Callable[[], None]) -> None:
        """``endpoint``: where the loader connects (one the daemon bound)."""
        self.entries = entries
        self.endpoint = endpoint
        self.done = done
        self._stopping = threading.Event()
        self._loader: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="cuctxd-preload", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop loading (any thread): the loader running now is terminated, the rest are not started."""
        self._stopping.set()
        with self._lock:
            if self._loader is not None:
                with contextlib.suppress(ProcessLookupError):
                    self._loader.terminate()
        if self.thread.ident is not None:
            self.thread.join(10.0)

    def _run(self) -> None:
        loads = [(entry, name, device) for entry in self.entries for name, device in entry.targets()]
        loaded = 0
        try:
            for entry, name, device in loads:
                if self._stopping.is_set():
                    return
                loaded += self._load(entry, name, device)
        finally:
            if not self._stopping.is_set():
                log.info("preload done: %d of %d checkpoint load(s) published; ready", loaded, len(loads))
                self.done()

    def _load(self, entry: Preload, name: str, device: int) -> bool:
        """One ``cuctx load``; True when the name serves the checkpoint."""
        command = [sys.executable, "-m", "cuctxd.client", "--endpoint", self.endpoint, "--timeout", "60", "load",
                   entry.path, "--name", name, "--device", str(device), "--replace"]
        started = time.monotonic()
        with self._lock:
            if self._stopping.is_set():
                return False
            self._loader = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        out, err = self._loader.communicate()
        code = self._loader.returncode
        with self._lock:
            self._loader = None
        if self._stopping.is_set():  # terminated by stop(): the daemon is on its way out
            return False
        if code == 0:
            log.info("preload: %s on device %d from %s in %.1f s: %s", name, device, entry.path,
                     time.monotonic() - started, out.strip().splitlines()[-1] if out.strip() else "published")
            return True
        said = (err.strip() or out.strip() or f"exit status {code}").splitlines()[-1]
        log.error("preload: skipping %s on device %d from %s: %s", name, device, entry.path, said)
        return False
