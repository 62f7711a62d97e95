"""The daemon assembled: backend, one worker per device, the front socket, clean shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import zmq

from daemon.backends.base import Driver
from daemon.config import DaemonConfig
from daemon.device_state import DeviceLimits
from daemon.endpoint import ipc_path, prepare_ipc, remove_ipc
from daemon.front import Front
from daemon.front_state import FrontState
from daemon.sharing import ShareRegistry
from daemon.worker import DeviceWorker
from protos.limits import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

_REPLY_ENDPOINT = "inproc://cuctxd-replies"


class Daemon:
    """Start with :meth:`start`, run :meth:`serve` on the front thread, end with :meth:`close`.

    :meth:`stop` may be called from any thread or a signal handler: it only
    writes a byte to a pipe the front thread polls.
    """

    def __init__(self, config: DaemonConfig, driver: Driver) -> None:
        self.config = config
        self.driver = driver
        self._zmq = zmq.Context()
        self._stop_read, self._stop_write = os.pipe()
        os.set_blocking(self._stop_write, False)
        self._workers: list[DeviceWorker] = []
        self._ipc_files: list[Path] = []
        self._front: Front | None = None
        self.bound: list[str] = []

    def start(self) -> None:
        replies = self._zmq.socket(zmq.PULL)
        replies.bind(_REPLY_ENDPOINT)
        count = self.driver.device_count()
        limits = DeviceLimits(self.config.max_payload, self.config.session_quota, self.config.device_reserve)
        shares = ShareRegistry()
        self._workers = [
            DeviceWorker(self.driver, n, self._zmq, _REPLY_ENDPOINT, limits, shares) for n in range(count)
        ]
        peers = {w.device: w for w in self._workers}
        devices = []
        for worker in self._workers:
            worker.peers = peers
            devices.append(worker.start().info)
        router = self._bind_router()
        state = FrontState(self.config, self.driver.name, devices, shares)
        self._front = Front(state, self._workers, router, replies)
        log.info("serving %d %s device(s) on %s", count, self.driver.name, ", ".join(self.bound))

    def _bind_router(self) -> zmq.Socket[Any]:
        router = self._zmq.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_payload + MAX_HEADER_BYTES)
        router.setsockopt(zmq.LINGER, 0)
        for endpoint in self.config.endpoints:
            path = ipc_path(endpoint)
            if path is not None:
                prepare_ipc(path)
            router.bind(endpoint)
            bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.bound.append(bound)
            if path is not None:
                path.chmod(0o600)
                self._ipc_files.append(path)
        return router

    def serve(self) -> None:
        assert self._front is not None, "start() first"
        self._front.serve(self._stop_read)

    def stop(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a stop is already pending
            os.write(self._stop_write, b"x")

    def close(self) -> None:
        """Free every session's contexts and memory, close sockets, remove ipc socket files."""
        for worker in self._workers:
            worker.stop()
        if self._front is not None:
            self._front.router.close()
            self._front.replies.close()
        self._zmq.term()
        for path in self._ipc_files:
            remove_ipc(path)
        os.close(self._stop_read)
        os.close(self._stop_write)
        log.info("stopped")
