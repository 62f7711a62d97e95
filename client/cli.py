"""``cuctx``: talk to a running cuctxd from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from client.client import Client
from client.format import devices_table, shared_table, status_text
from protos.errors import CuctxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuctx", description="Query a running cuctxd daemon.")
    parser.add_argument("--endpoint", help="daemon endpoint (default: $CUCTXD_ENDPOINT, else the per-user socket)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon (default 10)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True)
    ping = commands.add_parser("ping", help="round-trip time to the daemon")
    ping.add_argument("-c", "--count", type=int, default=1, help="number of pings")
    commands.add_parser("devices", help="the devices the daemon serves")
    commands.add_parser("status", help="sessions, contexts and memory per device")
    commands.add_parser("shared", help="published buffers and who holds them")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.endpoint, timeout=args.timeout, name="cuctx") as client:
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


if __name__ == "__main__":
    sys.exit(main())
