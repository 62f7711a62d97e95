"""``cuctxd``: run the daemon in the foreground (under systemd: ``Type=notify``, see daemon/systemd/).

Settings come from built-in defaults, then ``--config FILE`` (TOML, keys as
the long flags in snake_case), then the flags given. Any bad setting exits 2
with a message naming it; ``--print-config`` shows the result as TOML.
``cuctxd keygen DIR [--name NAME]`` writes a CURVE key pair instead
(:mod:`cuctxd.daemon.service.keygen`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cuctxd.daemon import __version__
from cuctxd.daemon.backends import BackendUnavailable, select_backend
from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.queues import DEFAULT_MAX_QUEUED_REQUESTS
from cuctxd.daemon.device.worker import WorkerStartError
from cuctxd.daemon.service import keygen
from cuctxd.daemon.service.config import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_CONTEXTS_PER_SESSION,
    DEFAULT_MAX_OBJECTS_PER_SESSION,
    DEFAULT_MAX_ORPHANED_SHARES,
    DEFAULT_MAX_SHARES_PER_SESSION,
    DEFAULT_METRICS_HOST,
    SIZE_HELP,
    ConfigError,
    DaemonConfig,
    check_config,
)
from cuctxd.daemon.service.config_file import KEYS, build_config, check_endpoint, load_file, render_toml
from cuctxd.daemon.service.endpoint import EndpointInUse
from cuctxd.daemon.service.logs import flush_logs, setup_logging
from cuctxd.daemon.service.metrics import MetricsUnavailable
from cuctxd.daemon.service.server import Daemon
from cuctxd.daemon.side_channel.server import DEFAULT_MAX_FD_CONNECTIONS_PER_PEER
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.endpoints import default_endpoint

log = logging.getLogger("cuctxd.daemon")

#: Exit status for a bad configuration or anything else that stops the daemon from starting.
EXIT_CONFIG = 2


def _flag_type(name: str) -> Callable[[str], Any]:
    """argparse ``type=`` running key ``name``'s check, so a flag and the file accept the same values."""
    key = KEYS[name]

    def convert(text: str) -> Any:
        try:
            return key.check(key.from_text(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _endpoint_type(text: str) -> str:
    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuctxd",
        description="CUDA context daemon: serves the machine's GPUs to client processes over ZeroMQ. "
                    "'cuctxd keygen DIR [--name NAME]' writes a CURVE key pair.",
        epilog=SIZE_HELP + ".",
        argument_default=argparse.SUPPRESS,
    )
    add = parser.add_argument
    add("--version", action="version", version=f"cuctxd {__version__}")
    add("--config", metavar="FILE", help="TOML file of settings (keys: the long options in snake_case); "
                                         "options given here override it")
    add("--print-config", action="store_true", default=False,
        help="print the effective configuration as TOML and exit")
    add("--endpoint", action="append", dest="endpoints", metavar="URL", type=_endpoint_type,
        help=f"where to listen: ipc://PATH or tcp://HOST:PORT (PORT * takes any free port); repeatable "
             f"(default {default_endpoint()})")
    add("--backend", type=_flag_type("backend"), metavar="auto|cuda|sim",
        help="driver backend; auto (default) uses cuda when a driver and a device are present")
    add("--sim-devices", type=_flag_type("sim_devices"), metavar="N", help="devices of the sim backend (default 2)")
    add("--sim-memory", type=_flag_type("sim_memory"), metavar="SIZE", help="memory per sim device (default 1GiB)")
    add("--devices", type=_flag_type("devices"), metavar="ORDINALS",
        help="serve only these driver ordinals, e.g. 2,0; clients see them as devices 0..n-1 (default: all)")
    add("--max-payload", type=_flag_type("max_payload"), metavar="SIZE",
        help="largest payload frame a request or reply may carry (default 1GiB)")
    add("--lease-ttl", type=_flag_type("lease_ttl"), metavar="SECONDS",
        help="reap a session after this long without a request or heartbeat (default 5)")
    add("--session-quota", type=_flag_type("session_quota"), metavar="SIZE",
        help="most memory one session may hold on each device (default: no quota)")
    add("--device-reserve", type=_flag_type("device_reserve"), metavar="SIZE",
        help="memory of each device that allocations must leave free (default 0)")
    add("--drain-timeout", type=_flag_type("drain_timeout"), metavar="SECONDS",
        help=f"on SIGTERM/SIGINT, wait this long for requests in flight (default {DEFAULT_DRAIN_TIMEOUT:g})")
    add("--log-level", type=_flag_type("log_level"), metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR")
    add("--log-format", type=_flag_type("log_format"), metavar="text|json",
        help="text (default) or json: one JSON object per line")
    add("--orphan-ttl", type=_flag_type("orphan_ttl"), metavar="SECONDS",
        help="free a published buffer whose owner left after this long without a consumer (default 600)")
    add("--sim-fault", type=_flag_type("sim_fault"), metavar="DEV:CALLS:ERROR",
        help="testing aid (sim backend only): device DEV turns sticky with ERROR after CALLS more calls")
    add("--device-endpoints", action=argparse.BooleanOptionalAction,
        help="give each device its own socket next to each endpoint, so device ops skip a thread hand-off "
             "(default on; --no-device-endpoints when only the one socket or port may be used)")
    add("--busy-poll-us", type=_flag_type("busy_poll_us"), metavar="US",
        help="microseconds each device worker keeps polling, without sleeping, after a request: a "
             "client's next one is then taken at once, at the cost of that CPU time (default 300 on "
             "hosts with 8 or more CPUs, else 0)")
    add("--metrics-port", type=_flag_type("metrics_port"), metavar="PORT",
        help="serve Prometheus metrics on this port (default 0: off; needs the 'metrics' extra)")
    add("--metrics-host", type=_flag_type("metrics_host"), metavar="ADDRESS",
        help=f"address the metrics endpoint binds (default {DEFAULT_METRICS_HOST})")
    add("--node-name", type=_flag_type("node_name"), metavar="NAME",
        help="what status and the metrics call this machine (default: the host name; in a Kubernetes pod, "
             "pass the node's name)")
    security = parser.add_argument_group("security and limits")
    security.add_argument("--group", type=_flag_type("group"), metavar="NAME",
                          help="group whose members may use the ipc:// socket (directory 0770, socket 0660)")
    security.add_argument("--insecure-tcp", action=argparse.BooleanOptionalAction,
                          help="allow tcp:// endpoints without CURVE (plaintext, no authentication)")
    security.add_argument("--server-key", type=_flag_type("server_key"), metavar="PATH",
                          help="CURVE secret key file of the daemon (required for tcp:// without --insecure-tcp)")
    security.add_argument("--allow-dir", type=_flag_type("allow_dir"), metavar="PATH",
                          help="directory of the CURVE public keys (NAME.key) of clients let in; needed with "
                               "--server-key")
    security.add_argument("--max-sessions-per-peer", type=_flag_type("max_sessions_per_peer"), metavar="N",
                          help="most sessions one peer may hold open (default 0: no limit)")
    security.add_argument("--max-objects-per-session", type=_flag_type("max_objects_per_session"), metavar="N",
                          help="most contexts, buffers, streams, events and share holds one session may have "
                               f"on each device (default {DEFAULT_MAX_OBJECTS_PER_SESSION}; 0: no limit)")
    security.add_argument("--max-queued-requests", type=_flag_type("max_queued_requests"), metavar="N",
                          help="most requests one session may have queued on each device "
                               f"(default {DEFAULT_MAX_QUEUED_REQUESTS}; 0: no limit)")
    security.add_argument("--max-queued-bytes", type=_flag_type("max_queued_bytes"), metavar="SIZE",
                          help="most payload bytes one session may have queued on each device, beyond its "
                               "first request (default 256MiB; 0: no limit)")
    security.add_argument("--max-reply-bytes", type=_flag_type("max_reply_bytes"), metavar="SIZE",
                          help="read results one session's client may leave untaken on each device before "
                               "its reads are refused (default 256MiB; 0: no limit)")
    security.add_argument("--max-contexts-per-session", type=_flag_type("max_contexts_per_session"), metavar="N",
                          help="most contexts one session may create on each device "
                               f"(default {DEFAULT_MAX_CONTEXTS_PER_SESSION}; 0: no limit)")
    security.add_argument("--max-shares-per-session", type=_flag_type("max_shares_per_session"), metavar="N",
                          help="most shares one session may have exported plus held open on each device "
                               f"(default {DEFAULT_MAX_SHARES_PER_SESSION}; 0: no limit)")
    security.add_argument("--max-orphaned-shares", type=_flag_type("max_orphaned_shares"), metavar="N",
                          help="most published buffers whose owner left and nobody holds, daemon-wide; beyond "
                               f"it the oldest are freed (default {DEFAULT_MAX_ORPHANED_SHARES}; 0: no limit)")
    security.add_argument("--max-connections", type=_flag_type("max_connections"), metavar="N",
                          help="most client connections at once; beyond it new ones are refused until some close "
                               "(default 0: half of what the open-file limit leaves once a quarter of it is kept "
                               "for the daemon; the other half is max-client-fds)")
    security.add_argument("--handshake-timeout", type=_flag_type("handshake_timeout"), metavar="SECONDS",
                          help="drop a connection that has not finished its ZeroMQ/CURVE handshake by then "
                               f"(default {DEFAULT_HANDSHAKE_TIMEOUT:g})")
    security.add_argument("--host-memory-per-session", type=_flag_type("host_memory_per_session"), metavar="SIZE",
                          help="bytes of host buffers (host_alloc, staging rings) one session may have on each "
                               "device (default 4GiB; 0: no limit)")
    security.add_argument("--max-host-memory", type=_flag_type("max_host_memory"), metavar="SIZE",
                          help="bytes of host buffers of all sessions on each device, pinned memory "
                               "(default: a quarter of the host's memory; 0: no limit)")
    security.add_argument("--max-fd-connections", type=_flag_type("max_fd_connections"), metavar="N",
                          help="most connections to the fd channel at once (default 256)")
    security.add_argument("--fd-ticket-ttl", type=_flag_type("fd_ticket_ttl"), metavar="SECONDS",
                          help="how long a ticket for the fd channel stays redeemable (default 30)")
    security.add_argument("--max-tickets-per-session", type=_flag_type("max_tickets_per_session"), metavar="N",
                          help="fd channel tickets one session may have waiting (default 64; 0: no limit)")
    security.add_argument("--max-shm-lanes", type=_flag_type("max_shm_lanes"), metavar="N",
                          help="shm lanes open to each device at once; beyond, sessions use the socket "
                               "(default 1024; 0: no limit)")
    security.add_argument("--max-client-fds", type=_flag_type("max_client_fds"), metavar="N",
                          help="most fds the daemon holds for clients (tickets, shm lanes, host buffers, fd "
                               "channel connections) (default 0: what the open-file limit leaves beside the "
                               "daemon's reserve and max-connections)")
    security.add_argument("--max-client-fds-per-peer", type=_flag_type("max_client_fds_per_peer"), metavar="N",
                          help="of those, most held for one peer: a process, or a group member's uid "
                               "(default 0: a quarter of max-client-fds)")
    security.add_argument("--max-client-fds-per-session", type=_flag_type("max_client_fds_per_session"),
                          metavar="N", help="of those, most held for one session (default 0: an eighth of "
                                            "max-client-fds)")
    security.add_argument("--max-fd-connections-per-peer", type=_flag_type("max_fd_connections_per_peer"),
                          metavar="N", help="most fd channel connections of one peer at once "
                                            f"(default {DEFAULT_MAX_FD_CONNECTIONS_PER_PEER}; 0: no limit)")
    security.add_argument("--max-sessions-per-uid", type=_flag_type("max_sessions_per_uid"), metavar="N",
                          help="most sessions the processes of one user may hold open together, where the "
                               "kernel tells the user (ipc://) (default 0: no limit)")
    security.add_argument("--max-orphaned-bytes-per-uid", type=_flag_type("max_orphaned_bytes_per_uid"),
                          metavar="SIZE", help="bytes of published buffers whose owner left and nobody holds, per "
                                               "user and device; publish is refused beyond it (default 0: half "
                                               "the device's memory)")
    security.add_argument("--max-manifest-bytes-per-session", type=_flag_type("max_manifest_bytes_per_session"),
                          metavar="SIZE", help="bytes of the names (manifests included) one session may have "
                                               "published (default 16MiB; 0: no limit)")
    security.add_argument("--max-manifest-bytes-per-uid", type=_flag_type("max_manifest_bytes_per_uid"),
                          metavar="SIZE", help="bytes of the names (manifests included) one user's sessions may "
                                               "have published, ended ones included (default 64MiB; 0: no limit)")
    security.add_argument("--max-reply-bytes-per-peer", type=_flag_type("max_reply_bytes_per_peer"), metavar="SIZE",
                          help="read results one peer's clients may leave untaken on each device, all its "
                               "sessions together, before their reads are refused (default 512MiB; 0: no limit)")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> tuple[DaemonConfig, bool]:
    """The effective configuration and whether ``--print-config`` was asked; exits 2 if it is bad."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    print_config = bool(args.pop("print_config"))
    path = args.pop("config", None)
    if "endpoints" in args:
        args["endpoints"] = tuple(args["endpoints"])
    try:
        from_file = load_file(path) if path is not None else {}
        config = build_config(from_file, args, default_endpoint())
        check_config(config)
    except ConfigError as exc:
        parser.exit(EXIT_CONFIG, f"cuctxd: {exc}\n")
    return config, print_config


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["keygen"]:
        return keygen.main(args[1:])
    config, print_config = parse_config(args)
    if print_config:
        sys.stdout.write(render_toml(config))
        return 0
    setup_logging(config.log_level, config.log_format)
    try:
        driver, reason = select_backend(
            config.backend, sim_devices=config.sim_devices, sim_memory=config.sim_memory
        )
    except BackendUnavailable as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    log.info("backend %s: %s", driver.name, reason)
    if config.sim_fault is not None:
        if not isinstance(driver, SimDriver):
            log.error("configuration key 'sim_fault': needs the sim backend, not %s", driver.name)
            return EXIT_CONFIG
        device, after, name = config.sim_fault.split(":")
        driver.inject_sticky_error(int(device), CUresult[name], int(after))
        log.warning("sim fault injection: device %s turns sticky with %s after %s calls", device, name, after)
    try:
        daemon = Daemon(config, driver)
    except (ConfigError, MetricsUnavailable) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG

    def on_signal(signum: int, _frame: object) -> None:
        if daemon.stop_requested:
            daemon.force_exit(f"second {signal.Signals(signum).name}")
        log.info("%s: shutting down", signal.Signals(signum).name)
        daemon.stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    # A signal may land on any thread; only the main (front) thread runs Python handlers, so the
    # C-level handler also writes to the stop pipe the front polls. Only SIGINT/SIGTERM have handlers.
    signal.set_wakeup_fd(daemon.wakeup_fd, warn_on_full_buffer=False)
    try:
        daemon.start()
    except (ConfigError, EndpointInUse, OSError, zmq.ZMQError, WorkerStartError) as exc:
        log.error("cannot start: %s", exc)
        daemon.close()
        return EXIT_CONFIG
    print(f"cuctxd {__version__} listening on {' '.join(daemon.bound)} "
          f"(backend {driver.name}, {daemon.driver.device_count()} device(s))", flush=True)
    try:
        daemon.serve()
    finally:
        daemon.close()
    if daemon.exit_code:
        flush_logs()
        sys.stdout.flush()
        os._exit(daemon.exit_code)  # workers were abandoned: interpreter shutdown could wait on them
    return 0


if __name__ == "__main__":
    sys.exit(main())
