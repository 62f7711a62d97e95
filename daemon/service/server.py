"""The daemon assembled: backend, one worker per device, the front socket, and its life cycle.

Start: every worker opens its device and re-adopts the shares a previous daemon parked with
the service manager (:mod:`cuctxd.daemon.service.adoption`), then the front's ROUTER binds (tcp://
only with CURVE or ``insecure_tcp``), then each device's own ROUTER binds next
to every endpoint and goes to its worker (:mod:`cuctxd.daemon.worker.lane`; unless
``device_endpoints`` is off), then the metrics endpoint (if configured) and the
systemd liveness probe start; ``READY=1`` goes out once the front has answered
the probe's first ping (:mod:`cuctxd.daemon.service.liveness`).

Stop (:meth:`Daemon.stop`, SIGTERM/SIGINT): the front stops serving, then
*drains*: it keeps forwarding worker replies and answers every new request,
hello included, with ``CUCTXD_ERROR_SHUTTING_DOWN``, until every device request
in flight has been answered and the workers' queues are empty, or
``drain_timeout`` has passed (no session is reaped meanwhile: its client cannot renew
its lease). Then the workers close every session (contexts destroyed, memory freed;
shared memory excepted, which no stop scrubs or frees: it is left to the processes
that map it, :meth:`~cuctxd.daemon.device.sharing.Sharing.stop`), their last replies
are forwarded, sockets close and ipc:// socket files are removed. The drain deadline is final: once it has
passed, the workers are silenced (:meth:`DeviceWorker.silence`: queued and
pending work is dropped unanswered, no reply goes out on any socket) and
closing is bounded by :data:`STOP_GRACE`: the process exits within
``drain_timeout`` + ``max(1, min(STOP_GRACE, drain_timeout))`` s of the signal
(a worker whose operation runs past that is abandoned). A drain that timed out
exits with status 1, as work was dropped unanswered. A second signal exits at once
(:meth:`Daemon.force_exit`), still removing the socket files.

Security (``protos/PROTOCOL.md``, "Security"): with ``server_key`` every
ROUTER (front and devices) is a CURVE server on every endpoint it binds, ipc:// included, and a ZAP
authenticator thread admits only clients whose public key is in ``allow_dir``
(:meth:`Daemon._secure_router`). The liveness probe's inproc:// connection is
not subject to CURVE (libzmq runs no security handshake over inproc), which is
safe since only this process can reach it. ``group`` opens the ipc:// socket to
one group (:func:`cuctxd.daemon.service.endpoint.prepare_ipc`); ``max_sessions_per_peer`` is
enforced by the front (hello), ``max_objects_per_session`` by each device's
:class:`~cuctxd.daemon.device.state.DeviceState`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from cuctxd.daemon.backends.base import Driver
from cuctxd.daemon.backends.subset import DeviceSubset
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.front.lookups import LookupLimits, LookupPool
from cuctxd.daemon.front.loop import Front
from cuctxd.daemon.intake.connections import ConnectionWatch, ListenerGuard, listen_backlog
from cuctxd.daemon.intake.observe import ObservedSessions, RequestObserver
from cuctxd.daemon.intake.router_io import REPLY_LINGER_MS
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.connection_budget import ConnectionBudget
from cuctxd.daemon.registry.daemon_state import AdmissionConfig, AdmissionLimits, DaemonState
from cuctxd.daemon.registry.fd_budget import FdBudget, FdLimits, FdPlan
from cuctxd.daemon.registry.parking import ParkingLimits, ParkingLot
from cuctxd.daemon.registry.shares import ShareLimits, ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook, TicketLimits
from cuctxd.daemon.service.adoption import adopt_parked, open_parking
from cuctxd.daemon.service.config import ConfigError, DaemonConfig, check_config
from cuctxd.daemon.service.endpoint import (
    clear_stale_socket,
    ipc_path,
    lane_endpoint,
    open_ipc_socket,
    prepare_ipc,
    remove_ipc,
)
from cuctxd.daemon.service.gpu_limit import gpu_limit
from cuctxd.daemon.service.liveness import PROBE_ENDPOINT, FrontProbe
from cuctxd.daemon.service.logs import flush_logs
from cuctxd.daemon.service.metrics import DaemonMetrics
from cuctxd.daemon.service.notify import Notifier
from cuctxd.daemon.service.preload import Preloader
from cuctxd.daemon.service.rlimits import NOFILE_CAP, raise_open_file_limit
from cuctxd.daemon.settings import part_of
from cuctxd.daemon.side_channel.server import FdChannelLimits, SideChannel
from cuctxd.daemon.worker.lane import DeviceLane
from cuctxd.daemon.worker.loop import DeviceWorker
from cuctxd.daemon.worker.runner import JobRunner
from cuctxd.protos.fd_channel import channel_path
from cuctxd.protos.limits import MAX_HEADER_BYTES

if TYPE_CHECKING:
    import zmq.auth.thread

log = logging.getLogger(__name__)

_REPLY_ENDPOINT = "inproc://cuctxd-replies"
#: Most seconds the workers get to close every session once the drain is over (at least 1 s, at most
#: ``drain_timeout``: an operator asking for a quick drain wants a quick exit).
STOP_GRACE = 5.0
#: Exit status after a second signal, a drain that timed out, or when workers had to be abandoned.
EXIT_FORCED = 1


class Daemon:
    """Start with :meth:`start`, run :meth:`serve` on the front thread, end with :meth:`close`.

    :meth:`stop` may be called from any thread or a signal handler: it only
    writes a byte to a pipe the front thread polls. :attr:`exit_code` is what
    the process should exit with once :meth:`close` returns.
    """

    def __init__(self, config: DaemonConfig, driver: Driver) -> None:
        check_config(config)
        if config.devices is not None:
            try:
                driver = DeviceSubset.wrap(driver, config.devices)
            except ValueError as exc:
                raise ConfigError("devices", str(exc)) from None
        self.config = config
        self.driver = driver
        self.ordinals: tuple[int, ...] = config.devices or tuple(range(driver.device_count()))
        self.notifier = Notifier.from_environment()
        self.metrics = DaemonMetrics() if config.metrics_port else None
        self.metrics_url: str | None = None
        self.exit_code = 0
        self._zmq = zmq.Context()
        self._stop_read, self._stop_write = os.pipe()
        os.set_blocking(self._stop_read, False)
        os.set_blocking(self._stop_write, False)
        self._stop_requested = False
        self._workers: list[DeviceWorker] = []
        self._ipc_files: list[Path] = []
        self._front: Front | None = None
        self._probe: FrontProbe | None = None
        self._backstop: threading.Timer | None = None
        self._drain_expired = False
        #: Reply payload bytes ZeroMQ held for clients at the drain monitor's last round.
        self._held_reply_bytes = 0
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
        self._curve: tuple[bytes, bytes] | None = None
        self.bound: list[str] = []
        self.connections: ConnectionBudget | None = None
        self._watch: ConnectionWatch | None = None
        self._backlog = 100
        self._tickets: TicketBook | None = None
        self._side_channel: SideChannel | None = None
        self.fd_budget: FdBudget | None = None
        self._parking: ParkingLot | None = None
        self._preloader: Preloader | None = None

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        old, new = raise_open_file_limit()
        if new != old:
            log.info("open-file limit raised from %d to %d", old, new)
        files = NOFILE_CAP if new == resource.RLIM_INFINITY else new
        config = self.config
        plan = FdPlan.derive(files, part_of(config, FdLimits))
        self.connections = ConnectionBudget(plan.connections)
        self.fd_budget = FdBudget(plan)
        self._backlog = listen_backlog(files)
        self._watch = ConnectionWatch()
        log.info("open-file limit %d: %d kept for the daemon, at most %d client connections at once "
                 "(max_connections), %d fds held for clients (max_client_fds; %d per peer, %d per session)",
                 files, plan.reserve, plan.connections, plan.client_fds, plan.per_peer, plan.per_session)
        replies = self._zmq.socket(zmq.PULL)
        replies.bind(_REPLY_ENDPOINT)
        count = self.driver.device_count()
        limits = part_of(config, DeviceLimits)
        shares = ShareRegistry(part_of(config, ShareLimits))
        parking, passed = open_parking(shares, self.fd_budget, part_of(config, ParkingLimits))
        self._parking = parking
        self._tickets = TicketBook(part_of(config, TicketLimits), self.fd_budget)
        queue_limits = part_of(config, QueueLimits)
        self._workers = [
            DeviceWorker(self.driver, n, self._zmq, _REPLY_ENDPOINT, limits, shares, self._tickets, queue_limits,
                         self.config.busy_poll_us / 1e6)
            for n in range(count)
        ]
        peers = {w.device: w for w in self._workers}
        devices = []
        for worker in self._workers:
            worker.peers = peers
            devices.append(worker.start().info)
        if parking is not None:
            adopt_parked(parking, passed, self._workers, devices)
        try:
            router = self._bind_router()
        except BaseException:
            replies.close()
            raise
        self._side_channel = self._open_side_channel()
        sessions = ObservedSessions(self.metrics, receivers=1 + count)
        state = DaemonState(self._front_config(), self.driver.name, devices, shares, sessions=sessions,
                           endpoints=list(self.bound), connections=self.connections, fd_channel=self._side_channel,
                           fd_budget=self.fd_budget, request_stop=self._stop_asked)
        if config.gpu_limit:
            state.device_limit = gpu_limit(config, devices)
        self._front = Front(state, self._workers, router, replies)
        if config.gpu_limit:
            self._front.lookups = lookups = LookupPool(part_of(config, LookupLimits))
            state.lookup_status = lookups.to_status
        self._front.observer = RequestObserver(self.metrics)
        state.device_endpoints = self._open_lanes(state, self._front.observer)
        self._watch.start()
        if self.metrics is not None:
            self.metrics.watch(state, self._workers, self.ordinals)
            try:
                self.metrics_url = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
            except OSError as exc:
                raise OSError(exc.errno, f"metrics on {self.config.metrics_host}:{self.config.metrics_port}: "
                                         f"{exc.strerror or exc}") from exc
            log.info("metrics on %s", self.metrics_url)
        mapping = "" if self.config.devices is None else f" (driver ordinals {list(self.ordinals)})"
        log.info("serving %d %s device(s)%s on %s", count, self.driver.name, mapping, ", ".join(self.bound))
        if config.preload:
            state.ready = False
            loader_endpoint = next((e for e in self.bound if e.startswith("ipc://")), self.bound[0])
            self._preloader = Preloader(config.preload, loader_endpoint, partial(setattr, state, "ready", True))
            self._preloader.start()
        if self.notifier.enabled:
            self._probe = FrontProbe(self._zmq, self.notifier, self._status_line)
            self._probe.start()

    def _open_side_channel(self) -> SideChannel | None:
        """The fd channel beside every ipc:// endpoint (bound in the directories the endpoints checked)."""
        paths = [path for path in map(channel_path, self.config.endpoints) if path is not None]
        if not paths or self._tickets is None:
            return None
        files = [Path(path) for path in paths if not path.startswith("@")]
        for file in files:
            clear_stale_socket(file)
        channel = SideChannel(paths, self._tickets, handshake_timeout=self.config.handshake_timeout,
                              limits=part_of(self.config, FdChannelLimits))
        channel.start()
        for file in files:
            open_ipc_socket(file, self.config.group)
        log.info("fd channel on %s", ", ".join(paths))
        return channel

    def _front_config(self) -> AdmissionConfig:
        """The front's admission: its own settings, and what the assembly knows besides."""
        config = self.config
        return AdmissionConfig(**vars(part_of(config, AdmissionLimits)), endpoints=tuple(config.endpoints),
                               device_ordinals=self.ordinals, queue_limits=part_of(config, QueueLimits))

    def _bind_router(self) -> zmq.Socket[Any]:
        """The front's ROUTER, bound to every endpoint (and the liveness probe's)."""
        router, guard = self._new_router()
        try:
            for endpoint in self.config.endpoints:
                self.bound.append(self._bind(router, endpoint))
                if endpoint.startswith("tcp://") and self.config.server_key is None:
                    log.warning("listening on %s WITHOUT encryption or authentication (insecure_tcp): anyone "
                                "who can reach this port can use every GPU served and read its memory",
                                self.bound[-1])
            if self.notifier.enabled:
                router.bind(PROBE_ENDPOINT)
        except BaseException:
            router.close()
            raise
        guard.watch(self.bound)
        return router

    def _open_lanes(self, state: DaemonState, observer: RequestObserver) -> list[list[str]]:
        """Bind each device's own ROUTER next to every endpoint and hand it to its worker; the endpoints."""
        if not self.config.device_endpoints:
            return []
        lanes = []
        for worker in self._workers:
            router, guard = self._new_router()
            try:
                bound = [self._bind(router, lane_endpoint(endpoint, worker.device))
                         for endpoint in self.config.endpoints]
            except BaseException:
                router.close()
                raise
            guard.watch(bound)
            worker.open_lane(DeviceLane(worker.device, router, state, observer))
            lanes.append(bound)
        return lanes

    def _new_router(self) -> tuple[zmq.Socket[Any], ListenerGuard]:
        """A ROUTER with the daemon's options, and its connection guard (monitoring before any bind),
        which the connection watch owns from now on."""
        assert self.connections is not None and self._watch is not None, "start() sets them first"
        router = self._zmq.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.MAXMSGSIZE, self.config.max_payload + MAX_HEADER_BYTES)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.HANDSHAKE_IVL, int(self.config.handshake_timeout * 1000))
            router.setsockopt(zmq.BACKLOG, self._backlog)
            self._secure_router(router)
            guard = ListenerGuard(router, self.connections)
        except BaseException:
            router.close()
            raise
        self._watch.add(guard)
        return router, guard

    def _bind(self, router: zmq.Socket[Any], endpoint: str) -> str:
        """Bind ``endpoint`` (an ipc:// one private to this user or ``group``); the endpoint bound."""
        path = ipc_path(endpoint)
        if path is not None:
            prepare_ipc(path, self.config.group)
        router.bind(endpoint)
        if path is not None:
            self._ipc_files.append(path)
            open_ipc_socket(path, self.config.group)
        return router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _secure_router(self, router: zmq.Socket[Any]) -> None:
        """With ``server_key``: make ``router`` a CURVE server and admit only the keys in ``allow_dir``.

        Called before the first bind, so no endpoint is ever served in
        plaintext. CURVE covers the whole socket: ipc:// endpoints bound with
        tcp:// ones need client keys too. The ZAP authenticator runs on its own
        thread in this daemon's ZeroMQ context, serves every ROUTER (the front's
        and the devices'), and is stopped in :meth:`close`; it rereads nothing,
        so keys added to ``allow_dir`` need a restart. Each admitted client's z85
        public key becomes the User-Id of its frames, which the front uses as the
        peer for ``max_sessions_per_peer``. Raises :class:`ConfigError` for an
        unreadable key or a missing ``allow_dir``.
        """
        if self.config.server_key is None:
            return
        if self._curve is None:
            self._curve = self._start_curve()
        public, secret = self._curve
        router.curve_server = True
        router.curve_secretkey = secret
        router.curve_publickey = public

    def _start_curve(self) -> tuple[bytes, bytes]:
        """Load the server key pair and start the ZAP authenticator; the key pair."""
        import zmq.auth.thread  # here: it loads asyncio, about 15 ms of every start, and only CURVE needs it

        assert self.config.server_key is not None
        if self.config.allow_dir is None:
            raise ConfigError("allow_dir", "server_key turns CURVE on, which needs allow_dir: the directory of "
                                           "public keys (NAME.key) of the clients let in")
        try:
            public, secret = zmq.auth.load_certificate(self.config.server_key)
        except (OSError, ValueError) as exc:
            raise ConfigError("server_key", f"cannot load a CURVE key pair from {self.config.server_key}: "
                                            f"{exc}") from None
        if secret is None:
            raise ConfigError("server_key", f"{self.config.server_key} holds only a public key; give the "
                                            "secret key file (NAME.key_secret written by 'cuctxd keygen')")
        allowed = zmq.auth.load_certificates(self.config.allow_dir)
        if not allowed:
            log.warning("allow_dir %s holds no client public keys: every client will be turned away",
                        self.config.allow_dir)
        authenticator = zmq.auth.thread.ThreadAuthenticator(self._zmq, log=logging.getLogger("cuctxd.daemon.zap"))
        authenticator.start()
        self._authenticator = authenticator
        authenticator.configure_curve(domain="*", location=self.config.allow_dir)
        log.info("CURVE on: server public key %s, %d client key(s) allowed from %s",
                 public.decode(), len(allowed), self.config.allow_dir)
        return public, secret

    def _status_line(self) -> str:
        """STATUS= text for systemd; read on the probe thread (sizes and flags only)."""
        front = self._front
        if front is None:
            return "starting"
        state = front.state
        what = "draining" if state.draining else "serving"
        return (f"{what} {len(state.devices)} {state.backend} device(s), {len(state.sessions)} session(s) "
                f"on {', '.join(self.bound)}")

    # --- serve, drain ------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until :meth:`stop`, then drain (see the module docstring); returns when drained."""
        assert self._front is not None, "start() first"
        self._front.serve(self._stop_read)
        self._drain()

    def stop(self) -> None:
        """Ask the front to stop and drain; signal-safe (the drain itself runs in :meth:`serve`)."""
        self._stop_requested = True
        with contextlib.suppress(BlockingIOError):  # a stop is already pending
            os.write(self._stop_write, b"x")

    def _stop_asked(self, who: str) -> None:
        """The op ``shutdown`` (front thread): the same drain as SIGTERM, logged with who asked."""
        if not self._stop_requested:
            log.info("shutdown asked by %s: shutting down", who)
        self.stop()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def wakeup_fd(self) -> int:
        """For ``signal.set_wakeup_fd``: a signal landing on any thread then wakes the front at once."""
        return self._stop_write

    def _consume_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._stop_read, 4096):
                pass

    def force_exit(self, reason: str) -> None:
        """Exit now, without draining: remove the ipc socket files and ``os._exit``. Never returns."""
        log.warning("%s: exiting at once without draining", reason)
        for path in self._ipc_files:
            with contextlib.suppress(OSError):
                remove_ipc(path)
        flush_logs()
        os._exit(EXIT_FORCED)

    def _drain(self) -> None:
        front = self._front
        assert front is not None
        if self._preloader is not None:  # before its loader's requests are refused as the drain's
            self._preloader.stop()
        front.state.draining = True
        for worker in self._workers:
            worker.submit_task(_end_waits)
        self.notifier.stopping(self._status_line())
        timeout = self.config.drain_timeout
        in_flight = front.observer.in_flight if front.observer is not None else 0
        log.info("draining: %d device request(s) in flight, queue depths %s; waiting up to %g s",
                 in_flight, [w.queue_depth() for w in self._workers], timeout)
        self._backstop = threading.Timer(timeout + STOP_GRACE + 5.0, self.force_exit,
                                         args=("shutdown did not finish in time",))
        self._backstop.daemon = True
        self._backstop.start()
        drained: list[bool] = []
        monitor = threading.Thread(target=self._watch_drain, args=(time.monotonic() + timeout, drained),
                                   name="cuctxd-drain", daemon=True)
        started = time.monotonic()
        self._consume_wakeups()
        monitor.start()
        while not drained:  # the monitor wakes the front through the stop pipe; so does a second signal
            front.serve(self._stop_read)
            self._consume_wakeups()
        monitor.join(1.0)
        if drained[0]:
            log.info("drained in %.3f s", time.monotonic() - started)
        else:
            log.warning("drain timed out after %g s: %d device request(s) unanswered, queue depths %s, %d reply "
                        "byte(s) not yet taken by their clients; no more replies go out", timeout,
                        front.observer.in_flight if front.observer is not None else 0,
                        [w.queue_depth() for w in self._workers], self._held_reply_bytes)
            self._drain_expired = True
            self.exit_code = EXIT_FORCED

    def _watch_drain(self, deadline: float, drained: list[bool]) -> None:
        """Drain monitor thread: wake the front (the stop pipe) once idle, or at ``deadline`` (silencing the
        workers first, so that no reply leaves after it however late the front wakes).

        Idle is two rounds in a row after which no worker has anything queued,
        every device request the front dispatched has had its reply forwarded, and
        ZeroMQ holds no reply payload for any client (a slow reader's replies have
        left, :meth:`DeviceWorker.held_replies`): a round is a count queued on every
        worker, so when it has run everything queued before it has too; the second
        round covers work that a job of the first passed on to another device (a
        cross-device copy's second half).
        """
        front = self._front
        assert front is not None
        quiet_rounds = 0
        result = False
        while time.monotonic() < deadline:
            marks = [threading.Event() for _ in self._workers]
            held = [0] * len(self._workers)
            for index, (worker, mark) in enumerate(zip(self._workers, marks, strict=True)):
                worker.held_replies(partial(_report, held, index, mark))
            if not all(mark.wait(max(0.0, deadline - time.monotonic())) for mark in marks):
                break
            self._held_reply_bytes = sum(held)
            idle = all(w.queue_depth() == 0 for w in self._workers) and (
                front.observer is None or front.observer.in_flight == 0) and not self._held_reply_bytes
            quiet_rounds = quiet_rounds + 1 if idle else 0
            if quiet_rounds >= 2:
                result = True
                break
            time.sleep(0.005 if idle else 0.02)
        if not result:  # the deadline is final: silence the workers now, not once the front has woken
            for worker in self._workers:
                worker.silence()
        drained.append(result)
        self.stop()

    # --- close -------------------------------------------------------------------------

    def close(self) -> None:
        """Free every session's contexts and memory (shared memory excepted: left to whoever maps it), close
        sockets, remove ipc socket files.

        Bounded: workers that have not finished their queue and closed their
        sessions within :data:`STOP_GRACE` (at most ``drain_timeout``) are
        abandoned, and ``exit_code`` becomes :data:`EXIT_FORCED`.
        """
        if self._preloader is not None:
            self._preloader.stop()
        if self._probe is not None:
            self._probe.stop()
        if self._watch is not None:
            self._watch.stop()
        if self.metrics is not None:
            self.metrics.close()
        grace = max(1.0, min(STOP_GRACE, self.config.drain_timeout))
        stuck = self._stop_workers(self._workers, grace)
        if self._side_channel is not None:
            self._side_channel.stop()
        elif self._tickets is not None:
            self._tickets.close()
        if self._front is not None:
            if not self._drain_expired:  # past the drain deadline nothing more is forwarded
                self._front.flush_replies(20)
                self._front.router.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
            self._front.router.close()
            self._front.replies.close()
            if self._front.lookups is not None:
                self._front.lookups.stop()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if stuck:
            log.error("device worker(s) %s did not stop within %g s; exiting without closing their sessions",
                      stuck, grace)
            self.exit_code = EXIT_FORCED
        else:
            self._zmq.term()
        for path in self._ipc_files:
            remove_ipc(path)
        with contextlib.suppress(ValueError):  # ValueError: not on the main thread, so not set from here
            previous = signal.set_wakeup_fd(-1)  # the pipe closes next: no signal may write to its number
            if previous not in (-1, self._stop_write):
                signal.set_wakeup_fd(previous)
        os.close(self._stop_read)
        os.close(self._stop_write)
        self.notifier.close()
        if self._parking is not None:
            self._parking.close()
        if self._backstop is not None:
            self._backstop.cancel()
        log.info("stopped")

    @staticmethod
    def _stop_workers(workers: Sequence[DeviceWorker], grace: float) -> list[int]:
        """Stop all workers at once (each closes its sessions); the devices whose thread is still alive."""
        started = [w for w in workers if w.thread.ident is not None]
        for worker in started:
            worker.stop(timeout=0)
        deadline = time.monotonic() + grace
        for worker in started:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            worker.close()
        return [w.device for w in started if w.thread.is_alive()]


def _report(held: list[int], index: int, mark: threading.Event, count: int) -> None:
    """A worker's answer to :meth:`DeviceWorker.held_replies`: when it comes, everything queued before it
    has run."""
    held[index] = count
    mark.set()


def _end_waits(runner: JobRunner) -> None:
    """A device worker's task at the drain's start: its waits for new versions end (``DeviceState.draining``)."""
    runner.state.draining = True
