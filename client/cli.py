"""``cuctx``: talk to a running cuctxd from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from cuctxd.client.client import Client
from cuctxd.client.doctor import FAIL, run_checks
from cuctxd.client.format import devices_table, doctor_text, shared_table, status_text, watch_frame
from cuctxd.client.transport import curve_keys
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import CuctxError


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuctx", description="Query a running cuctxd daemon.")
    parser.add_argument("--endpoint", help="daemon endpoint (default: $CUCTXD_ENDPOINT, else the per-user socket)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon (default 10)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--server-key", metavar="PATH",
                        help="CURVE: the daemon's public key file (server.key); needed for a daemon with server_key")
    parser.add_argument("--client-key", metavar="PATH",
                        help="CURVE: this client's secret key file (NAME.key_secret; its NAME.key must be in the "
                             "daemon's allow_dir)")
    commands = parser.add_subparsers(dest="command", required=True)
    ping = commands.add_parser("ping", help="round-trip time to the daemon")
    ping.add_argument("-c", "--count", type=int, default=1, help="number of pings")
    commands.add_parser("devices", help="the devices the daemon serves")
    status = commands.add_parser("status", help="sessions, contexts and memory per device")
    status.add_argument("-w", "--watch", action="store_true", help="refresh like top until Ctrl-C")
    status.add_argument("-n", "--interval", type=_positive, default=2.0, metavar="S",
                        help="seconds between refreshes with --watch (default 2)")
    status.add_argument("--count", type=_count, metavar="N", help="with --watch: stop after N refreshes")
    commands.add_parser("shared", help="published buffers and who holds them")
    commands.add_parser("doctor", help="check that this process can use the daemon (exit 1 on any FAIL)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor(args)
    if args.command == "status" and args.watch:
        return watch_status(args)
    try:
        curve = curve_keys(args.server_key, args.client_key)
    except ValueError as exc:
        print(f"cuctx: {exc}", file=sys.stderr)
        return 2
    try:
        with Client(args.endpoint, timeout=args.timeout, name="cuctx", server_key=curve) as client:
            if args.command == "ping":
                times = [client.ping() for _ in range(max(1, args.count))]
                if args.json:
                    print(json.dumps({"endpoint": client.endpoint, "rtt_s": times}))
                else:
                    for t in times:
                        print(f"pong from {client.endpoint}: {t * 1e6:.0f} us "
                              f"(cuctxd {client.daemon_version}, backend {client.backend})")
            elif args.command == "devices":
                devices = client.devices()
                if args.json:
                    print(json.dumps([d.to_wire() for d in devices]))
                else:
                    print(devices_table(devices))
            elif args.command == "status":
                status = client.status()
                print(json.dumps(status) if args.json else status_text(status))
            elif args.command == "shared":
                shared = client.list_shared()
                print(json.dumps(shared) if args.json else shared_table(shared))
    except CuctxError as exc:
        print(f"cuctx: {exc}", file=sys.stderr)
        return 1
    return 0


def watch_status(args: argparse.Namespace) -> int:
    """Redraw ``status`` every ``--interval`` s; survives a daemon restart (reconnects). Ctrl-C exits 0.

    Exits 1 only when ``--count`` ran out and the last refresh failed.
    """
    endpoint = client_endpoint(args.endpoint)
    try:
        curve = curve_keys(args.server_key, args.client_key)
    except ValueError as exc:
        print(f"cuctx: {exc}", file=sys.stderr)
        return 2
    client: Client | None = None
    failed = False
    shown = 0
    try:
        while True:
            try:
                if client is None:
                    client = Client(endpoint, timeout=args.timeout, name="cuctx", server_key=curve)
                status = client.status()
                body = json.dumps(status) if args.json else status_text(status)
                failed = False
            except CuctxError as exc:
                body, failed = f"cuctx: {exc}", True
                if client is not None:
                    client.close()
                    client = None
            if args.json:
                print(body, flush=True)
            else:
                sys.stdout.write(watch_frame(body, endpoint, args.interval, time.strftime("%H:%M:%S")))
                sys.stdout.flush()
            shown += 1
            if args.count is not None and shown >= args.count:
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:
        failed = False
    finally:
        if client is not None:
            client.close()
    return 1 if failed else 0


def doctor(args: argparse.Namespace) -> int:
    checks = run_checks(client_endpoint(args.endpoint), args.timeout)
    if args.json:
        print(json.dumps([c.to_wire() for c in checks]))
    else:
        print(doctor_text(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
