"""``cuctxd``: run the daemon in the foreground."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import zmq

from daemon import __version__
from daemon.backends import BackendUnavailable, select_backend
from daemon.config import DEFAULT_LEASE_TTL, DaemonConfig, parse_size
from daemon.endpoint import EndpointInUse
from daemon.server import Daemon
from protos.endpoints import default_endpoint
from protos.limits import DEFAULT_MAX_PAYLOAD_BYTES

log = logging.getLogger("daemon")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuctxd",
        description="CUDA context daemon: serves the machine's GPUs to client processes over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"cuctxd {__version__}")
    parser.add_argument(
        "--endpoint", action="append", dest="endpoints", metavar="URL",
        help=f"where to listen (ipc:// or tcp://; repeatable; default {default_endpoint()})",
    )
    parser.add_argument("--backend", choices=("auto", "cuda", "sim"), default="auto",
                        help="driver backend; auto uses cuda when a driver and a device are present")
    parser.add_argument("--sim-devices", type=int, default=2, metavar="N",
                        help="devices of the sim backend (default 2)")
    parser.add_argument("--sim-memory", type=parse_size, default=parse_size("1GiB"), metavar="SIZE",
                        help="memory per sim device (default 1GiB)")
    parser.add_argument("--max-payload", type=parse_size, default=DEFAULT_MAX_PAYLOAD_BYTES, metavar="SIZE",
                        help="largest payload frame a request or reply may carry (default 1GiB)")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL, metavar="SECONDS",
                        help="reap a session after this long without a request or heartbeat (default 5)")
    parser.add_argument("--session-quota", type=parse_size, default=0, metavar="SIZE",
                        help="most memory one session may hold on each device (default: no quota)")
    parser.add_argument("--device-reserve", type=parse_size, default=0, metavar="SIZE",
                        help="memory of each device that allocations must leave free (default 0)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def parse_config(argv: Sequence[str] | None = None) -> DaemonConfig:
    args = build_parser().parse_args(argv)
    if args.sim_devices < 0:
        raise SystemExit("cuctxd: --sim-devices must not be negative")
    if args.lease_ttl <= 0:
        raise SystemExit("cuctxd: --lease-ttl must be positive")
    return DaemonConfig(
        endpoints=tuple(args.endpoints or [default_endpoint()]),
        backend=args.backend,
        sim_devices=args.sim_devices,
        sim_memory=args.sim_memory,
        max_payload=args.max_payload,
        log_level=args.log_level,
        lease_ttl=args.lease_ttl,
        session_quota=args.session_quota,
        device_reserve=args.device_reserve,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s",
        stream=sys.stderr,
    )
    try:
        driver, reason = select_backend(
            config.backend, sim_devices=config.sim_devices, sim_memory=config.sim_memory
        )
    except BackendUnavailable as exc:
        log.error("%s", exc)
        return 2
    log.info("backend %s: %s", driver.name, reason)
    daemon = Daemon(config, driver)
    try:
        daemon.start()
    except (EndpointInUse, OSError, zmq.ZMQError) as exc:
        log.error("cannot listen: %s", exc)
        daemon.close()
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: daemon.stop())
    print(f"cuctxd {__version__} listening on {' '.join(daemon.bound)} "
          f"(backend {driver.name}, {driver.device_count()} device(s))", flush=True)
    try:
        daemon.serve()
    finally:
        daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
