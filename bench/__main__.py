"""``python -m bench``: start a daemon and the anchors, measure every figure, print a table, write JSON."""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.figures import GROUPS
from bench.records import Figure, failed
from bench.report import table, write_json
from bench.run import Bench
from bench.settings import FULL, QUICK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few samples: a smoke run in under a minute")
    parser.add_argument("--backend", choices=("auto", "cuda", "sim"), default="auto",
                        help="backend of the daemon this run starts (default auto)")
    parser.add_argument("--sim-devices", type=int, default=2, metavar="N",
                        help="devices of the sim backend (default 2; figure 6a needs 2)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures as JSON here")
    parser.add_argument("--only", metavar="N,N", help="run only these figure groups (e.g. 1,4)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when any target is missed (without it, only a figure that broke does)")
    return parser


def exit_status(figures: Sequence[Figure], check: bool) -> int:
    """1 if a figure broke, or with ``check`` if any target was missed; else 0."""
    if any(f.error for f in figures):
        return 1
    return 1 if check and any(f.passed is False for f in figures) else 0


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: no process is left behind


def run_groups(bench: Bench, only: set[int] | None) -> list[Figure]:
    figures: list[Figure] = []
    for group in GROUPS:
        if only is not None and group.FIGURE not in only:
            continue
        daemon = bench.daemon
        if daemon is not None and daemon.process.poll() is not None:
            figures.append(failed(group.FIGURE, group.TITLE, f"not run: the daemon exited earlier with "
                                  f"{daemon.process.returncode}:\n{daemon.log_tail()}"))
            continue
        print(f"figure {group.FIGURE}: {group.TITLE} ...", file=sys.stderr, flush=True)
        try:
            for figure in group.run(bench):
                figures.append(figure)
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if daemon is not None and daemon.process.poll() is not None:
                detail += f"\nthe daemon exited with {daemon.process.returncode}:\n{daemon.log_tail()}"
            traceback.print_exc(file=sys.stderr)
            figures.append(failed(group.FIGURE, group.TITLE, detail))
    return figures


def _meta(bench: Bench, quick: bool, started: float, wall: float) -> dict[str, Any]:
    import msgpack
    import zmq

    meta: dict[str, Any] = {
        "backend": bench.backend, "requested_backend": bench.requested_backend,
        "devices": bench.device_count, "device_names": sorted({d.name for d in bench.devices}),
        "daemon_version": bench.daemon_version, "daemon_banner": bench.daemon.banner if bench.daemon else None,
        "quick": quick, "host": platform.node(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(wall, 1),
    }
    try:
        from importlib.metadata import version

        meta["cuda_bindings"] = version("cuda-bindings")
    except Exception:
        meta["cuda_bindings"] = None
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = {int(n) for n in args.only.split(",")} if args.only else None
    signal.signal(signal.SIGTERM, _terminate)
    settings = QUICK if args.quick else FULL
    started, clock = time.time(), time.perf_counter()
    with Bench(settings, args.backend, args.sim_devices) as bench:
        figures = run_groups(bench, only)
        meta = _meta(bench, args.quick, started, time.perf_counter() - clock)
    print(table(figures, meta))
    if args.json is not None:
        write_json(args.json, figures, meta)
        print(f"wrote {args.json}")
    return exit_status(figures, args.check)


if __name__ == "__main__":
    sys.exit(main())
