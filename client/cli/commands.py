"""``cuctx``: talk to a running cuctxd from the shell.

The global options (``--endpoint``, ``--timeout``, ``--json``, the CURVE keys)
are accepted before or after the command: ``cuctx devices --json`` and
``cuctx --json devices`` mean the same; where both are given, the later wins.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from cuctxd.client.api.client import Client
from cuctxd.client.cli.doctor import FAIL, run_checks
from cuctxd.client.cli.layouts import inspect_layout, inspect_text
from cuctxd.client.cli.tables import (
    devices_table,
    doctor_text,
    human_duration,
    shared_table,
    status_text,
    watch_frame,
)
from cuctxd.client.wire.socket_transport import CurveKeys, curve_keys
from cuctxd.client.wire.transport import listening, someone_listens
from cuctxd.protos import digests
from cuctxd.protos.endpoints import ENDPOINT_ENV, BadEndpoint, check_endpoint, client_endpoint
from cuctxd.protos.errors import BadArgument, CuctxError
from cuctxd.protos.sizes import human_size
from cuctxd.protos.version import __version__

if TYPE_CHECKING:
    from cuctxd.client.tensors.safetensors_load import Loaded

#: Exit status for a usage error (what argparse uses too).
EXIT_USAGE = 2


class UsageError(Exception):
    """A bad option value found after parsing (an endpoint, a key file): one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, with a "did you mean" for a misspelled choice, and a pointer
    to ``--help`` instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {did_you_mean(message)} (try '{self.prog} --help')\n")


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")


def did_you_mean(message: str) -> str:
    """argparse's "invalid choice" message with the closest choice suggested, when one is close."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    choices = re.findall(r"'([^']*)'", match.group("choices"))
    close = difflib.get_close_matches(match.group("given"), choices, n=1, cutoff=0.6)
    if not close:
        return message
    return (f"{message[:match.start()]}invalid choice: '{match.group('given')}'; did you mean '{close[0]}'? "
            f"(choose from {match.group('choices')})")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _ordinal(text: str) -> int:
    """A device index or a session id: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _devices(text: str) -> str:
    """``cuctx load --device``: ``all``, ``N`` or ``N,M,...`` (each 0 or more, each once), checked before any daemon
    is asked; the devices the daemon serves are checked when it is (``CUDA_ERROR_INVALID_DEVICE``)."""
    from cuctxd.client.tensors.copies import parse_devices

    try:
        parse_devices(text)
    except BadArgument as error:
        raise argparse.ArgumentTypeError(error.message) from None
    return text


def _add_global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options every command takes; on a command's parser (``defaults=False``) an option left out
    keeps what was given before the command, or the main parser's default."""

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument("--endpoint", default=default(None),
                       help=f"daemon endpoint, ipc://PATH or tcp://HOST:PORT (default: ${ENDPOINT_ENV}, "
                            "else the per-user socket where it exists, else /run/cuctxd/cuctxd.sock where it exists)")
    group.add_argument("--timeout", type=_seconds, default=default(10.0),
                       help="seconds to wait for the daemon, connecting included (default 10)")
    group.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    group.add_argument("--server-key", metavar="PATH", default=default(None),
                       help="CURVE: the daemon's public key file (server.key); needed for a daemon with server_key")
    group.add_argument("--client-key", metavar="PATH", default=default(None),
                       help="CURVE: this client's secret key file (NAME.key_secret; its NAME.key must be in the "
                            "daemon's allow_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cuctx", description="Query and manage a running cuctxd daemon.",
                     epilog="'cuctx help COMMAND' shows the options of one command.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"cuctx {__version__}")
    _add_global_options(parser, defaults=True)
    globals_ = _Parser(add_help=False, allow_abbrev=False)
    _add_global_options(globals_, defaults=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, parents=[globals_], allow_abbrev=False)

    ping = command("ping", "round-trip time to the daemon")
    ping.add_argument("-c", "--count", type=_count, default=1, help="number of pings")
    ping.add_argument("--wait", type=_seconds, default=None, metavar="S",
                      help="wait up to S seconds for a daemon to listen (one just started), instead of failing at "
                           "once when nothing listens")
    ping.add_argument("--ready", action="store_true", help="then exit 1 while the daemon is still preloading its "
                                                           "checkpoints (a readiness probe)")
    command("devices", "the devices the daemon serves")
    status = command("status", "sessions, contexts and memory per device")
    status.add_argument("-w", "--watch", action="store_true", help="refresh like top until Ctrl-C")
    status.add_argument("-n", "--interval", type=_seconds, default=2.0, metavar="S",
                        help="seconds between refreshes with --watch (default 2)")
    status.add_argument("--count", type=_count, metavar="N", help="with --watch: stop after N refreshes")
    shared = command("shared", "published buffers and who holds them (every page of them)")
    shared.add_argument("--prefix", default=None, help="only names that start with PREFIX")
    shared.add_argument("--owner", type=_ordinal, default=None, metavar="SESSION",
                        help="only names published by this session (its id, as the OWNER column lists it)")
    shared.add_argument("--uid", type=_ordinal, default=None, help="only names published by this user's sessions")
    load = command("load", "publish a safetensors checkpoint (a file, a directory of shards or an index) as one "
                           "layout")
    load.add_argument("path", metavar="PATH", help="a .safetensors file, a directory (its "
                                                   "model.safetensors.index.json, else every *.safetensors in it) "
                                                   "or an index .json")
    load.add_argument("--name", required=True, help="the name to publish the layout under")
    load.add_argument("--device", type=_devices, default=None, metavar="N",
                      help="the device (default: 0); N,M,... or 'all': a copy on each, read onto the first and "
                           "filled from it on the GPU; a name present elsewhere with this content gets a copy here")
    load.add_argument("--read-only", action="store_true", help="consumers may open the layout only read-only")
    load.add_argument("--replace", action="store_true", help="if the name holds other content, swap it for this "
                                                            "(sessions that opened the old one keep it)")
    load.add_argument("--version", action="store_true", help="publish it as the name's next version (sessions "
                                                            "holding the previous one keep it)")
    wait = command("wait-version", "wait until a name has a version newer than --after, and print its number")
    wait.add_argument("name", metavar="NAME", help="the versioned name")
    wait.add_argument("--after", type=_ordinal, default=0, metavar="N", help="the version you have (default 0)")
    wait.add_argument("--wait", type=_seconds, default=None, metavar="S",
                      help="give up after S seconds (exit 1; default: wait until it comes)")
    inspect = command("inspect", "one layout: its tensors (dtype, shape, offset, bytes), digest, copies and holders")
    inspect.add_argument("name", metavar="NAME", help="the layout's name, as 'cuctx shared' lists it")
    unpublish = command("unpublish", "remove a published name (one published by your user; any, as the "
                                     "daemon's user)")
    unpublish.add_argument("name", metavar="NAME", help="the name, as 'cuctx shared' lists it")
    unpublish.add_argument("--device", type=_ordinal, default=None, metavar="N",
                           help="remove only the name's copy on device N (default: every copy)")
    kill = command("kill", "close a session as its own goodbye would (your user's sessions; any, as the "
                           "daemon's user)")
    kill.add_argument("session", metavar="SESSION", type=_ordinal, help="the session's id, as 'cuctx status' "
                                                                        "lists it")
    command("shutdown", "stop the daemon as SIGTERM does: drain, then exit (only the daemon's own user)")
    command("doctor", "check that this process can use the daemon (exit 1 on any FAIL)")
    help_ = commands.add_parser("help", help="this help, or the help of one command",
                                description="this help, or the help of one command")
    help_.add_argument("topic", nargs="?", metavar="COMMAND", help="the command to explain")
    parser.set_defaults(command_parsers=commands.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except BrokenPipeError:  # the reader went away (``cuctx status -w | head``): no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit fails no more
        return 1


def run(argv: Sequence[str] | None = None) -> int:
    """:func:`main` without the broken-pipe handling: parse, then run one command; the exit status."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    misspelled = unknown_option(parser, argv)
    if misspelled is not None:
        print(f"cuctx: {misspelled} (try 'cuctx --help')", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if args.command == "help":
        return show_help(parser, args.topic)
    try:
        endpoint = _endpoint(args.endpoint)
        curve = curve_keys(args.server_key, args.client_key)
        if args.command == "load" and not args.name:
            raise UsageError("--name: the name to publish under must not be empty")
    except (UsageError, ValueError) as exc:
        print(f"cuctx: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "doctor":
        return doctor(args, endpoint, curve)
    if args.command == "status" and args.watch:
        return watch_status(args, endpoint, curve)
    if args.command == "ping" and args.wait is not None:
        _wait_for_listener(endpoint, args.wait)
    try:
        with _client(endpoint, args, curve) as client:
            if args.command == "ping":
                times = [client.ping() for _ in range(args.count)]
                if args.json:
                    print(json.dumps({"endpoint": client.endpoint, "rtt_s": times}))
                else:
                    for t in times:
                        print(f"pong from {client.endpoint}: {human_duration(t)} "
                              f"(cuctxd {client.daemon_version}, backend {client.backend})")
                if args.ready and not client.status().get("ready", True):
                    print("cuctx: not ready: the daemon is still preloading its checkpoints", file=sys.stderr)
                    return 1
            elif args.command == "devices":
                devices = client.devices()
                memory = _memory_by_device(client.status())
                if args.json:
                    print(json.dumps([{**d.to_wire(), "memory": memory.get(d.index)} for d in devices]))
                else:
                    print(devices_table(devices, memory))
            elif args.command == "status":
                status = client.status()
                print(json.dumps(status) if args.json else status_text(status, own_session=client.session_id))
            elif args.command == "shared":
                shared = client.list_shared(prefix=args.prefix, owner=args.owner, uid=args.uid)
                print(json.dumps(shared) if args.json else shared_table(shared))
            elif args.command == "load":
                return load_file(client, args)
            elif args.command == "wait-version":
                version = client.wait_version(args.name, args.after, args.wait)
                _say(args, {"name": args.name, "version": version}, f"{args.name!r} version {version}")
            elif args.command == "inspect":
                layout = inspect_layout(client, args.name)
                print(json.dumps(layout) if args.json else inspect_text(layout))
            elif args.command == "unpublish":
                client.unpublish(args.name, device=args.device)
                where = "" if args.device is None else f" on device {args.device}"
                _say(args, {"unpublished": args.name, "device": args.device}, f"unpublished {args.name!r}{where}")
            elif args.command == "kill":
                client.close_session(args.session)
                _say(args, {"closed": args.session}, f"closed session {args.session}")
            elif args.command == "shutdown":
                pid = client.status()["pid"]
                client.shutdown()
                client.close()  # before the drain ends it
                return _wait_for_exit(args, endpoint, pid)
    except CuctxError as exc:
        if args.json:  # a script reading --json gets an error it can parse too
            print(json.dumps({"error": exc.name, "code": exc.code,
                              "message": str(exc)}), file=sys.stderr)
        else:
            print(f"cuctx: {exc}", file=sys.stderr)
        return 1
    return 0


def unknown_option(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The first ``--option`` neither ``cuctx`` nor its command knows, named with the closest known one, before
    argparse would report something else first (a required ``--name`` for ``load --nmae``)."""
    choices: dict[str, argparse.ArgumentParser] = parser.get_default("command_parsers")
    command = next((arg for arg in argv if arg in choices), None)
    known = {option for action in parser._actions for option in action.option_strings}
    if command is not None:
        known |= {option for action in choices[command]._actions for option in action.option_strings}
    for arg in argv:
        if arg == "--":
            break
        given = arg.split("=", 1)[0]
        if given.startswith("--") and given not in known:
            close = difflib.get_close_matches(given, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return f"unrecognized option '{given}'{hint}"
    return None


def _wait_for_listener(endpoint: str, seconds: float) -> None:
    """``ping --wait``: until something listens at ``endpoint`` or ``seconds`` pass (then ping says why not).
    A poll every 50 ms: a daemon starting elsewhere tells this process nothing."""
    deadline = time.monotonic() + seconds
    while not someone_listens(endpoint) and time.monotonic() < deadline:
        time.sleep(0.05)


def _client(endpoint: str, args: argparse.Namespace, curve: CurveKeys | None) -> Client:
    """A session for one command: ``--timeout`` bounds every wait, the handshake included."""
    return Client(endpoint, timeout=args.timeout, hello_timeout=args.timeout, name="cuctx", server_key=curve)


def _say(args: argparse.Namespace, wire: dict[str, Any], text: str) -> None:
    print(json.dumps(wire) if args.json else text)


def _memory_by_device(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each device's ``memory`` from a status map (daemons before it do not say)."""
    return {dev["device"]: dev["memory"] for dev in status.get("devices", []) if "memory" in dev}


def _wait_for_exit(args: argparse.Namespace, endpoint: str, pid: int) -> int:
    """After ``shutdown``: wait (up to ``--timeout``) for an ipc:// daemon's socket to go, and say so."""
    deadline = time.monotonic() + args.timeout
    stopped = None
    if endpoint.startswith("ipc://"):
        while listening(endpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = not listening(endpoint)
    if args.json:
        print(json.dumps({"shutdown": True, "pid": pid, "stopped": stopped}))
    elif stopped is None:
        print(f"cuctxd (pid {pid}) at {endpoint} is shutting down")
    elif stopped:
        print(f"cuctxd (pid {pid}) at {endpoint} has stopped")
    else:
        print(f"cuctxd (pid {pid}) at {endpoint} is still draining after {args.timeout:g} s", file=sys.stderr)
        return 1
    return 0


def load_file(client: Client, args: argparse.Namespace) -> int:
    """``cuctx load``: the checkpoint's tensors published as ``--name`` (a directory of tensor-parallel ranks: one
    layout per rank, ``NAME/rank-R``, on the device given for it), with one progress line for all its files on a
    terminal; the same content already there is said and left as it is."""
    from cuctxd.client.tensors.checkpoints import tensor_parallel_ranks
    from cuctxd.client.tensors.copies import parse_devices, served_devices
    from cuctxd.client.tensors.ranks import load_ranks, rank_name
    from cuctxd.client.tensors.safetensors_load import load_safetensors

    shown = False

    def progress(done: int, total: int) -> None:
        nonlocal shown
        if sys.stderr.isatty():
            shown = True
            print(f"\rloading {args.path}: {100 * done // max(total, 1):3d}% ({human_size(done)} of "
                  f"{human_size(total)})", end="", file=sys.stderr, flush=True)

    devices = None if args.device is None else served_devices(parse_devices(args.device), len(client.devices()))
    started = time.perf_counter()
    try:
        if tensor_parallel_ranks(args.path) and args.version:
            raise BadArgument("--version: a checkpoint of tensor-parallel ranks is one layout per rank, each its own "
                             "name; load each rank's files as a version of its own name")
        if tensor_parallel_ranks(args.path):
            ranks = load_ranks(client, args.path, args.name, devices=devices, progress=progress,
                               read_only=args.read_only, replace=args.replace)
            each: list[tuple[str, Loaded, list[int] | None]] = [
                (rank_name(args.name, rank), loaded, [loaded.descriptor.device]) for rank, loaded in enumerate(ranks)]
        else:
            each = [(args.name, load_safetensors(client, args.path, args.name, device=devices, progress=progress,
                                                 read_only=args.read_only, replace=args.replace,
                                                 version=args.version), devices)]
    finally:
        if shown:  # the progress line ends, so that what follows (an error too) starts a line of its own
            print(file=sys.stderr)
    took = time.perf_counter() - started
    for name, loaded, where in each:
        _say_loaded(args, name, loaded, where, took)
    return 0


def _say_loaded(args: argparse.Namespace, name: str, loaded: Loaded, devices: list[int] | None, took: float) -> None:
    """What ``cuctx load`` did with one layout (:class:`~cuctxd.client.tensors.safetensors_load.Loaded`)."""
    descriptor = loaded.descriptor
    if args.json:
        print(json.dumps({"name": name, "size": descriptor.size, "seconds": took, "loaded": loaded.loaded,
                          "replaced": loaded.replaced, "devices": devices, "copied": list(loaded.copied),
                          "version": descriptor.version,
                          "share_id": descriptor.share_id, "digest": loaded.digest}))
    elif not loaded.loaded:
        done = ("the copy just read was freed and the name left as it was" if args.replace
                else "nothing was read onto the device")
        if loaded.copied:
            done = (f"copied to device{'s' if len(loaded.copied) > 1 else ''} "
                    f"{', '.join(map(str, loaded.copied))} from device {descriptor.device} on the GPU")
        print(f"already loaded: same content, digest {loaded.digest} ({name!r}, "
              f"{human_size(descriptor.size)} on device {descriptor.device}); {done}")
    else:
        said = f", digest {digests.short(loaded.digest)}" if loaded.digest else ""
        where = (f"device {descriptor.device}" if not devices or len(devices) == 1
                 else f"devices {', '.join(map(str, devices))} (a copy on each)")
        as_version = f" version {descriptor.version}" if descriptor.version else ""
        print(f"{'replaced' if loaded.replaced else 'published'} {args.path} as {name!r}{as_version}: "
              f"{human_size(descriptor.size)} on {where} in {human_duration(took)}{said}")


def show_help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    """``cuctx help [COMMAND]``: the general help, or one command's; exit 2 for a command that does not exist."""
    if topic is None:
        parser.print_help()
        return 0
    commands: dict[str, argparse.ArgumentParser] = parser.get_default("command_parsers")
    if topic not in commands:
        close = difflib.get_close_matches(topic, list(commands), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"cuctx: no command {topic!r}{hint} (commands: {', '.join(commands)})", file=sys.stderr)
        return EXIT_USAGE
    commands[topic].print_help()
    return 0


def _endpoint(explicit: str | None) -> str:
    """The endpoint to use, checked; :class:`UsageError` naming where a bad one came from."""
    endpoint = client_endpoint(explicit)
    try:
        return check_endpoint(endpoint)
    except BadEndpoint as exc:
        source = "--endpoint" if explicit else f"${ENDPOINT_ENV}"
        raise UsageError(f"{source}: {exc}") from None


def watch_status(args: argparse.Namespace, endpoint: str, curve: CurveKeys | None) -> int:
    """Redraw ``status`` every ``--interval`` s; survives a daemon restart (reconnects). Ctrl-C exits 0.

    On a terminal each refresh clears the screen first; into a pipe or a file,
    frames follow one another as plain text. Exits 1 only when ``--count`` ran
    out and the last refresh failed.
    """
    clear = sys.stdout.isatty()
    client: Client | None = None
    failed = False
    shown = 0
    try:
        while True:
            try:
                if client is None:
                    client = _client(endpoint, args, curve)
                status = client.status()
                body = json.dumps(status) if args.json else status_text(status, own_session=client.session_id)
                failed = False
            except CuctxError as exc:
                body, failed = f"cuctx: {exc}", True
                if client is not None:
                    client.close()
                    client = None
            if args.json:
                print(body, flush=True)
            else:
                sys.stdout.write(watch_frame(body, endpoint, args.interval, time.strftime("%H:%M:%S"), clear=clear))
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


def doctor(args: argparse.Namespace, endpoint: str, curve: CurveKeys | None) -> int:
    checks = run_checks(endpoint, args.timeout, curve)
    if args.json:
        print(json.dumps([c.to_wire() for c in checks]))
    else:
        print(doctor_text(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
