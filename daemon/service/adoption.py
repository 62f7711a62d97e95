"""At start: set up parking with the service manager, and re-adopt what a previous daemon parked.

Called by :meth:`cuctxd.daemon.service.server.Daemon.start` once the device workers run and
before any endpoint is bound, so the first client already sees the adopted names. Each share
goes to the worker of the device whose UUID it was parked on; the workers import them
(:meth:`cuctxd.daemon.device.parking.DeviceParking.adopt`) and this waits for them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.registry.fd_budget import FdBudget
from cuctxd.daemon.registry.parked_records import ParkedShare
from cuctxd.daemon.registry.parking import ParkingLimits, ParkingLot
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.service.fdstore import ServiceFdStore, listen_fds
from cuctxd.daemon.worker.loop import DeviceWorker
from cuctxd.protos.records import DeviceInfo

log = logging.getLogger(__name__)

#: Most seconds the workers get to re-adopt the parked shares before the daemon serves without the rest.
ADOPT_TIMEOUT = 60.0


def open_parking(shares: ShareRegistry, budget: FdBudget | None,
                 limits: ParkingLimits) -> tuple[ParkingLot | None, list[tuple[str, int]]]:
    """The parking lot (set on ``shares``) where a service manager keeps fds, and the fds it passed us; parked
    fds count against ``budget``."""
    passed = listen_fds()
    store = ServiceFdStore.from_environment()
    if store is None:
        for name, fd in passed:
            log.warning("passed fd %d (%s) ignored: no fd store to keep it in", fd, name)
            os.close(fd)
        log.info("no service manager keeps fds for this daemon (NOTIFY_SOCKET unset, or FDSTORE=0): a restart "
                 "forgets every published name, persistent ones included")
        return None, []
    lot = ParkingLot(store, budget, limits)
    shares.parking = lot
    limit = "no limit given" if store.limit is None else f"at most {store.limit} fds"
    share = f"{lot.per_uid} per uid" if lot.per_uid else "no share per uid"
    log.info("persistent shares are parked with the service manager's fd store (%s, %s); %d fd(s) passed back",
             limit, share, len(passed))
    return lot, passed


def adopt_parked(lot: ParkingLot, passed: Sequence[tuple[str, int]], workers: Sequence[DeviceWorker],
                 devices: Sequence[DeviceInfo]) -> int:
    """Re-adopt the parked shares among ``passed`` on the workers of their devices; how many were adopted."""
    if not passed:
        return 0
    started = time.monotonic()
    recovered = lot.recover(passed)
    by_uuid = {info.uuid: worker for worker, info in zip(workers, devices, strict=True)}
    results: list[bool] = []
    waiting: list[threading.Event] = []
    for record, fd in recovered.shares:
        worker = by_uuid.get(record.device_uuid)
        if worker is None:
            log.warning("parked share %s… (names %s) was on device %s, which this daemon does not serve: skipped",
                        record.share_id[:8], [n.name for n in record.names], record.device_uuid)
            lot.forget(record.fdname, "its device is not served")
            os.close(fd)
            continue
        done = threading.Event()
        waiting.append(done)
        worker.run(_adoption(record, fd, results, done))
    deadline = started + ADOPT_TIMEOUT
    for done in waiting:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            log.error("parked shares not all adopted within %g s; serving without the rest", ADOPT_TIMEOUT)
            break
    lot.commit()
    adopted = sum(results)
    log.info("adopted %d parked share(s) in %.3f s (%d skipped)", adopted, time.monotonic() - started,
             recovered.skipped + len(recovered.shares) - adopted)
    return adopted


def _adoption(record: ParkedShare, fd: int, results: list[bool],
              done: threading.Event) -> Callable[[DeviceState], None]:
    """The worker's task: adopt ``record`` from ``fd`` (closed after), note the outcome, say it is done."""

    def adopt(state: DeviceState) -> None:
        try:
            adopted = state.parking.adopt(record, fd)
            results.append(adopted)
            share = state.sharing.shares.get(record.share_id) if adopted else None
            if share is not None:
                state.find_version_digests(share)
        finally:
            os.close(fd)
            done.set()

    return adopt
