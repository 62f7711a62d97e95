"""``cuctxd``: run the daemon in the foreground (under systemd: ``Type=notify``, see daemon/systemd/).

Settings come from built-in defaults, then ``--config FILE`` (TOML, keys as
the long flags in snake_case), then the flags given. Any bad setting exits 2
with a message naming it; ``--print-config`` shows the result as TOML.
``cuctxd keygen DIR [--name NAME]`` writes a CURVE key pair instead
(:mod:`cuctxd.daemon.service.keygen`).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import zmq

from cuctxd.daemon import __version__
from cuctxd.daemon.backends import BackendUnavailable, select_backend
from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.service.config import SETTINGS, ConfigError, DaemonConfig, check_config
from cuctxd.daemon.service.config_file import build_config, load_file, render_toml
from cuctxd.daemon.service.endpoint import EndpointInUse
from cuctxd.daemon.service.logs import flush_logs, setup_logging
from cuctxd.daemon.service.metrics import MetricsUnavailable
from cuctxd.daemon.service.server import Daemon
from cuctxd.daemon.settings import SIZE_HELP, Setting
from cuctxd.daemon.worker.loop import WorkerStartError
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.endpoints import default_endpoint

log = logging.getLogger("cuctxd.daemon")

#: Exit status for a bad configuration or anything else that stops the daemon from starting.
EXIT_CONFIG = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag (with a "did you mean" for a misspelled choice
    or flag) and a pointer to ``--help``, not the usage block (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {self._suggest(message)} (try '{self.prog} --help')\n")

    def _suggest(self, message: str) -> str:
        choice = re.search(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$", message)
        if choice is not None:
            options = re.findall(r"'([^']*)'", choice.group("choices"))
            close = difflib.get_close_matches(choice.group("given"), options, n=1, cutoff=0.6)
            return message if not close else (
                f"{message[:choice.start()]}invalid choice: '{choice.group('given')}'; did you mean "
                f"'{close[0]}'? (choose from {choice.group('choices')})")
        unknown = re.fullmatch(r"unrecognized arguments: (?P<given>\S+)(?P<rest>.*)", message)
        if unknown is not None and unknown.group("given").startswith("--"):
            flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
            close = difflib.get_close_matches(unknown.group("given").split("=")[0], flags, n=1, cutoff=0.6)
            if close:
                return f"{message}; did you mean {close[0]}?"
        return message


def _flag_type(declared: Setting) -> Callable[[str], Any]:
    """argparse ``type=`` running the setting's check, so a flag and the file accept the same values (a
    repeatable flag's value is one item of the list)."""

    def convert(text: str) -> Any:
        try:
            value = declared.from_text(text)
            return value if declared.repeat else declared.check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = declared.name
    return convert


def _add_flag(group: argparse._ActionsContainer, declared: Setting, shown: bool) -> None:
    """The setting's flag, made from its declaration (:mod:`cuctxd.daemon.settings`); ``shown``: listed in
    this parser's help (every flag is accepted either way)."""
    text = declared.help_text() if shown else argparse.SUPPRESS
    if declared.metavar is None:
        group.add_argument(declared.flag, action=argparse.BooleanOptionalAction, help=text)
    else:
        group.add_argument(declared.flag, dest=declared.name, metavar=declared.metavar, type=_flag_type(declared),
                           action="append" if declared.repeat else "store", help=text)


class _HelpAll(argparse.Action):
    """``--help-all``: the help of every setting, the advanced ones too (limits, fd internals, tuning, testing
    aids), then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **{**kwargs, "default": argparse.SUPPRESS})

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        build_parser(every=True).print_help()
        parser.exit()


def build_parser(every: bool = False) -> argparse.ArgumentParser:
    """The command line; its help lists the settings a user sets (``user=True``), or ``every`` one (what
    ``--help-all`` prints)."""
    hidden = sum(1 for declared in SETTINGS.values() if not declared.user)
    parser = _Parser(
        prog="cuctxd",
        description="CUDA context daemon: serves the machine's GPUs to client processes over ZeroMQ. "
                    "'cuctxd keygen DIR [--name NAME]' writes a CURVE key pair.",
        epilog=SIZE_HELP + "." + ("" if every else f" {hidden} more settings (limits, fd internals, tuning, "
                                                   "testing aids): cuctxd --help-all."),
        argument_default=argparse.SUPPRESS,
    )
    add = parser.add_argument
    add("--version", action="version", version=f"cuctxd {__version__}")
    add("--help-all", action=_HelpAll, help="show the help of every setting and exit")
    add("--config", metavar="FILE", help="TOML file of settings (keys: the long options in snake_case); "
                                         "options given here override it")
    add("--print-config", action="store_true", default=False,
        help="print the effective configuration as TOML and exit")
    security = parser.add_argument_group("security and limits")
    for declared in SETTINGS.values():
        _add_flag(security if declared.security else parser, declared, every or declared.user)
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
        check_config(config, from_flags=frozenset(args))
    except ConfigError as exc:
        parser.exit(EXIT_CONFIG, f"cuctxd: {exc}\n")
    return config, print_config


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["keygen"]:
        from cuctxd.daemon.service import keygen  # here: zmq.auth, which only keygen needs, is not every start's

        return keygen.main(args[1:])
    config, print_config = parse_config(args)
    if print_config:
        sys.stdout.write(render_toml(config))
        return 0
    setup_logging(config.log_level, config.log_format)
    try:
        driver, reason = select_backend(
            config.backend, sim_devices=config.sim_devices, sim_memory=config.sim_memory, sim_vmm=config.sim_vmm
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
