"""One benchmark run: the daemon, the anchor server, the client pool, the in-process driver.

:class:`Bench` starts everything the figures measure against and owns it;
:meth:`Bench.close` ends every process it started, whatever happened. The
figures get the :class:`Bench` and ask it for clients, endpoints and anchors.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.anchors import AnchorDevice, AnchorServer, AnchorUnavailable, start_anchor
from bench.cuda_local import LocalCuda, LocalDriverUnavailable
from bench.daemon_run import DaemonRun, start_daemon
from bench.pool import ClientPool
from bench.settings import Settings

#: Memory of each sim device: room for the 256 MiB copy pairs of the head-of-line figures.
SIM_MEMORY = "2GiB"


class Bench:
    """Everything one run measures; use as a context manager so it is always torn down."""

    def __init__(self, settings: Settings, backend: str, sim_devices: int) -> None:
        self.settings = settings
        self.requested_backend = backend
        self.sim_devices = sim_devices
        self.workdir = Path(tempfile.mkdtemp(prefix="cuctxd-b-", dir="/tmp"))  # short: ipc paths < 100 bytes
        self.daemon: DaemonRun | None = None
        self.anchor: AnchorServer | None = None
        self._device_anchor: AnchorServer | AnchorUnavailable | None = None
        self._pool: ClientPool | None = None
        self._local: LocalCuda | LocalDriverUnavailable | None = None
        self.backend = "?"
        self.daemon_version = "?"
        self.devices: list[Any] = []

    def __enter__(self) -> Bench:
        try:
            self.daemon = start_daemon(self.workdir, self.requested_backend, self.sim_devices, SIM_MEMORY)
            self.anchor = start_anchor(f"ipc://{self.workdir}/anchor.sock")
            with self.client() as client:
                self.backend = client.backend
                self.daemon_version = client.daemon_version
                self.devices = client.devices()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what figures ask for ---------------------------------------------------------

    def endpoint(self, transport: str = "ipc") -> str:
        assert self.daemon is not None
        return self.daemon.ipc if transport == "ipc" else self.daemon.tcp

    def anchor_endpoint(self, transport: str = "ipc") -> str:
        assert self.anchor is not None
        return self.anchor.endpoint(transport)

    def device_anchor_endpoint(self) -> str:
        """The ipc endpoint of the echo that reads each ``source`` reply from device 0 (the daemon's
        backend, in its own process); raises :class:`AnchorUnavailable`."""
        if self._device_anchor is None:
            uuid = self.devices[0].uuid if self.backend == "cuda" and self.devices else None
            try:
                self._device_anchor = start_anchor(f"ipc://{self.workdir}/device-anchor.sock",
                                                   device=AnchorDevice(self.backend, uuid))
            except AnchorUnavailable as unavailable:
                self._device_anchor = unavailable
        if isinstance(self._device_anchor, AnchorUnavailable):
            raise self._device_anchor
        return self._device_anchor.ipc

    def client(self, transport: str = "ipc") -> Any:
        from cuctxd.client import Client

        return Client(self.endpoint(transport), timeout=60, name="bench")

    def pool(self) -> ClientPool:
        if self._pool is None:
            self._pool = ClientPool(max(self.settings.client_counts))
        return self._pool

    def local_cuda(self) -> LocalCuda:
        """The CUDA driver in this process, on the daemon's device 0; raises LocalDriverUnavailable.

        Only when the daemon itself runs cuda (on sim, there is no GPU to compare with).
        """
        if self.backend != "cuda":
            raise LocalDriverUnavailable(f"needs the cuda backend; the daemon runs {self.backend}")
        if self._local is None:
            try:
                self._local = LocalCuda(self.devices[0].uuid if self.devices else None)
            except LocalDriverUnavailable as unavailable:
                self._local = unavailable
        if isinstance(self._local, LocalDriverUnavailable):
            raise self._local
        return self._local

    @property
    def device_count(self) -> int:
        return len(self.devices)

    # --- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """End every process this run started and remove its directory; safe to call twice."""
        try:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if isinstance(self._local, LocalCuda):
                self._local.close()
            self._local = None
        finally:
            try:
                for anchor in (self.anchor, self._device_anchor):
                    if isinstance(anchor, AnchorServer):
                        anchor.stop()
                self.anchor = self._device_anchor = None
            finally:
                if self.daemon is not None:
                    self.daemon.stop()
                shutil.rmtree(self.workdir, ignore_errors=True)


def alloc_supports_shareable() -> bool:
    """Whether ``Client.alloc`` takes ``shareable=`` (pool memory by default, cuMemAlloc when shareable)."""
    from cuctxd.client import Client

    return "shareable" in inspect.signature(Client.alloc).parameters


def alloc_shareable(client: Any, size: int, device: int | None = None) -> Any:
    """An exportable buffer: ``shareable=True`` where the client has it; before that every alloc is."""
    if alloc_supports_shareable():
        return client.alloc(size, device=device, shareable=True)
    return client.alloc(size, device=device)
