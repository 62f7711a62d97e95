"""How a daemon setting is declared, once: as a field of the limits object of the part of the daemon that uses it.

Each part's settings are a frozen dataclass next to the code they bound: :class:`DeviceLimits`
(``daemon/device/entries.py``), :class:`QueueLimits` (``daemon/registry/backlogs.py``),
:class:`AdmissionLimits` (``daemon/registry/daemon_state.py``), :class:`ShareLimits`, :class:`TicketLimits`,
:class:`FdLimits`, :class:`ParkingLimits` (``daemon/registry/``), :class:`FdChannelLimits`
(``daemon/side_channel/server.py``), and the service's own settings on
:class:`~cuctxd.daemon.service.config.DaemonConfig`, which inherits every part's class: the daemon's
configuration is their union, one flat set of keys, and no key may be declared twice (:func:`declared`
refuses it). The assembly hands each part its own object (:func:`part_of`), never a copy of single values.

Each field is made by one of the declarations below (:func:`size`, :func:`count`, :func:`seconds`,
:func:`switch`, :func:`choice`, or the general :func:`setting`), which holds everything the setting means
outside the daemon's code: its default, the check every value goes through (the configuration file's and
the command line's alike), how a command-line string becomes a value, how ``--print-config`` writes it
back, its ``--help`` text, whether a user sets it (``user=True``: listed by ``--help``; every other one only
by ``--help-all``), and whether it is a row of PROTOCOL.md's "Daemon limits" table. From that:

* the configuration-file key is the field's name (:mod:`cuctxd.daemon.service.config_file`);
* the flag is the name in kebab case, ``--max-queued-bytes`` (:mod:`cuctxd.daemon.service.cli`);
* ``--help`` and ``--help-all`` say the default, as :meth:`Setting.shown_default` writes it;
* PROTOCOL.md's limits table lists every ``limit=True`` setting once, with that flag and default
  (tests/unit/protos/test_protocol_doc.py holds the table to :func:`limit_rows`).

A new setting is one field of the limits object of the code it bounds, e.g. in ``ShareLimits``::

    max_widgets_per_uid: int = count(DEFAULT_MAX_WIDGETS_PER_UID, "most widgets one uid may hold",
                                     security=True, limit=True)

read there as ``self.limits.max_widgets_per_uid``, plus its row in PROTOCOL.md's table (what it bounds,
what a client gets when it is reached). A setting only the service layer reads is a field at the end of
``DaemonConfig`` itself. A new part's limits object is a frozen dataclass of such fields, added to
``DaemonConfig``'s bases and handed to the part by the assembly as ``part_of(config, NewLimits)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cuctxd.protos import endpoints
from cuctxd.protos.cuda_results import CUresult

T = TypeVar("T")

# --- sizes ------------------------------------------------------------------------------

#: Size suffixes, as docker and systemd read them: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024;
#: only an explicit KB/MB/GB/TB is decimal. Case does not matter.
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
#: What ``--help`` says a SIZE is.
SIZE_HELP = ("SIZE is bytes, or a number with K, M, G, T (also KiB, MiB, GiB, TiB: powers of 1024, "
             "512M = 512MiB) or KB, MB, GB, TB (powers of 1000)")
#: The units :func:`format_size` may write; binary first, so it wins a tie.
_RENDER_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                 ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` and ``"512M"`` -> 536870912, ``"1GB"`` -> 10**9; plain integers are bytes. ValueError on garbage."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64MiB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str | int:
    """The inverse of :func:`parse_size`, exact and short: ``512M`` -> ``"512MiB"``, ``2GB`` -> ``"2GB"``.

    Of the units that divide ``n``, the one leaving the fewest digits (binary on a tie); ``n`` itself
    when none does.
    """
    best: str | int = n
    digits = len(str(n)) + 1
    for unit, factor in _RENDER_UNITS:
        if n >= factor and n % factor == 0 and len(str(n // factor)) < digits:
            best, digits = f"{n // factor}{unit}", len(str(n // factor))
    return best


# --- value checks: a TOML-typed value in, the stored one out, or ValueError -----------------------

#: Most devices the sim backend can simulate (its own limit, repeated so checking needs no backend import).
MAX_SIM_DEVICES = 16
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) else kind


def integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {_show(value)}")
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise ValueError(f"must be {bound}, got {value}")
        return value
    return check


def positive_seconds(value: Any) -> float:
    return _seconds(value, zero=False)


def seconds_or_zero(value: Any) -> float:
    return _seconds(value, zero=True)


def _seconds(value: Any, *, zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number of seconds, got {_show(value)}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"must be {'0 or ' if zero else ''}a positive number of seconds, got {value}")
    return float(value)


def bytes_at_least(minimum: int = 0) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        size = parse_size(value)
        if size < minimum:
            raise ValueError(f"must be at least {minimum} bytes, got {value!r}")
        return size
    return check


def one_of(*choices: str, fold: Callable[[str], str] = str.lower) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str) or fold(value) not in choices:
            close = difflib.get_close_matches(fold(value), choices, n=1) if isinstance(value, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}{hint}")
        return fold(value)
    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {_show(value)}")
    return value


def string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {_show(value)}")
    return value


def check_endpoint(value: Any) -> str:
    """An endpoint the daemon can bind (the rules shared with clients: :mod:`cuctxd.protos.endpoints`)."""
    return endpoints.check_endpoint(value, bind=True)


def endpoint_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty array of URLs, got {_show(value)}")
    return tuple(check_endpoint(v) for v in value)


def ordinals(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty array of device ordinals, got {_show(value)}")
    checked = tuple(integer(0)(v) for v in value)
    if len(set(checked)) != len(checked):
        raise ValueError(f"lists a device twice: {list(checked)}")
    return checked


def ordinals_text(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"not a comma-separated list of device ordinals: {text!r} (e.g. 0,2)") from None


def existing_path(kind: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        path = Path(string(value)).expanduser()
        if kind == "file" and not path.is_file():
            raise ValueError(f"{str(path)!r} is not a readable file")
        if kind == "dir" and not path.is_dir():
            raise ValueError(f"{str(path)!r} is not a directory")
        return os.path.abspath(path)
    return check


def group_name(value: Any) -> str:
    name = string(value)
    try:
        grp.getgrgid(int(name)) if name.isdigit() else grp.getgrnam(name)
    except KeyError:
        raise ValueError(f"no such group: {name!r}") from None
    return name


def fault_injection(value: Any) -> str:
    """``DEVICE:AFTER_CALLS:CUDA_ERROR_NAME``: a sim-only fault injection for testing."""
    text = string(value)
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in CUresult.__members__:
        raise ValueError(f"{text!r} is not DEVICE:AFTER_CALLS:CUDA_ERROR_NAME (e.g. 1:40:CUDA_ERROR_ILLEGAL_ADDRESS)")
    return text


def _same(value: Any) -> Any:
    return value


class _NoDefault:
    def __repr__(self) -> str:
        return "no default"


#: The default of a setting that has none (the field must be given: ``endpoints``).
NO_DEFAULT: Any = _NoDefault()


# --- the declaration ------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One daemon setting as declared on its field (module docstring); :func:`declared` fills in ``name`` and
    ``default``."""

    #: A TOML-typed value in, the stored value out; ValueError saying what is wrong.
    check: Callable[[Any], Any]
    #: What ``--help`` says it does (its default is added: :meth:`shown_default`).
    help: str
    #: The flag's value in ``--help`` (``SIZE``, ``N``, ...); None for a switch (``--x``/``--no-x``).
    metavar: str | None
    #: A command-line string in, a TOML-typed value out (then :attr:`check`).
    from_text: Callable[[str], Any] = str
    #: The stored value out, a TOML-typed value for ``--print-config``.
    render: Callable[[Any], Any] = _same
    #: The default as ``--help`` and PROTOCOL.md say it, where the value does not (computed at start, say).
    shown: str | Callable[[], str] | None = None
    #: What 0 means for it ("no limit", "off"), said after the default in ``--help``.
    zero: str | None = None
    #: The flag, when not ``--`` + the name in kebab case; ``repeat``: the flag may be given again, each adding one.
    flag_name: str | None = None
    repeat: bool = False
    #: Listed under "security and limits" in ``--help``.
    security: bool = False
    #: A setting users set: ``--help`` lists it (at most 20 do); the others only ``--help-all``.
    user: bool = False
    #: A row of PROTOCOL.md's "Daemon limits" table.
    limit: bool = False
    name: str = ""
    default: Any = NO_DEFAULT

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    def shown_default(self) -> str | None:
        """The default in words (``1GiB``, ``5 s``, ``0: no limit``, ``on``); None when there is none to say."""
        if self.shown is not None:
            return self.shown if isinstance(self.shown, str) else self.shown()
        value = self.default
        if value is NO_DEFAULT or value is None:
            return None
        if isinstance(value, bool):
            return "on" if value else "off"
        if value == 0 and self.zero:
            return f"0: {self.zero}"
        if isinstance(value, float):
            return f"{value:g} s"
        return str(self.render(value))

    def help_text(self) -> str:
        shown = self.shown_default()
        if shown is None:
            return self.help
        zero = f"; 0: {self.zero}" if self.zero and self.default is not NO_DEFAULT and self.default != 0 else ""
        return f"{self.help} (default {shown}{zero})"


def setting(default: Any, check: Callable[[Any], Any], help: str, metavar: str | None, **more: Any) -> Any:
    """A dataclass field declaring a setting (``more``: the other :class:`Setting` fields)."""
    declaration = Setting(check, help, metavar, **more)
    if default is NO_DEFAULT:  # keyword-only: it may follow the inherited parts' fields, which have defaults
        return field(metadata={"setting": declaration}, kw_only=True)
    return field(default=default, metadata={"setting": declaration})


def size(default: int, help: str, *, minimum: int = 0, **more: Any) -> Any:
    """Bytes, written ``4096``, ``64MiB`` or ``8GB`` (:func:`parse_size`), and printed back so."""
    return setting(default, bytes_at_least(minimum), help, "SIZE", render=format_size, **more)


def count(default: int, help: str, *, low: int = 0, high: int | None = None, metavar: str = "N", **more: Any) -> Any:
    """A whole number in ``low..high``."""
    return setting(default, integer(low, high), help, metavar, from_text=int, **more)


def seconds(default: float, help: str, *, zero: str | None = None, **more: Any) -> Any:
    """A positive number of seconds; 0 too where ``zero`` says what it means."""
    check = positive_seconds if zero is None else seconds_or_zero
    return setting(default, check, help, "SECONDS", from_text=float, zero=zero, **more)


def switch(default: bool, help: str, **more: Any) -> Any:
    """True or false: ``--x`` and ``--no-x`` on the command line."""
    return setting(default, boolean, help, None, **more)


def choice(default: str, help: str, *choices: str, fold: Callable[[str], str] = str.lower, **more: Any) -> Any:
    """One of ``choices`` (compared after ``fold``)."""
    return setting(default, one_of(*choices, fold=fold), help, "|".join(choices), **more)


def declared(config_class: type) -> dict[str, Setting]:
    """The settings of ``config_class``'s fields, by name, with their names and defaults: its own fields first,
    then each class it inherits, in the order it names them (its method resolution order).

    TypeError for a field without a setting, or for one name declared by two classes (dataclasses would
    silently keep one of them)."""
    owners: dict[str, type] = {}
    for cls in config_class.__mro__:
        for name in vars(cls).get("__annotations__", {}):
            if name in owners and owners[name] is not cls and dataclasses.is_dataclass(cls):
                raise TypeError(f"setting {name!r} is declared by both {owners[name].__name__} and {cls.__name__}")
            owners.setdefault(name, cls)
    order = {cls: index for index, cls in enumerate(config_class.__mro__)}
    found: dict[str, Setting] = {}
    for each in sorted(dataclasses.fields(config_class), key=lambda f: order[owners[f.name]]):
        declaration = each.metadata.get("setting")
        if declaration is None:
            raise TypeError(f"{config_class.__name__}.{each.name} is declared without a setting")
        if each.default is not MISSING:
            default = each.default
        else:
            default = NO_DEFAULT if each.default_factory is MISSING else each.default_factory()
        found[each.name] = dataclasses.replace(declaration, name=each.name, default=default)
    return found


def part_of(config: Any, part: type[T]) -> T:
    """``part``'s own limits object, from a configuration that inherits its class: what the assembly hands
    the part (its fields, nothing else of the configuration)."""
    return part(**{each.name: getattr(config, each.name) for each in dataclasses.fields(part)})  # type: ignore[arg-type]


def limit_rows(settings: Mapping[str, Setting]) -> list[tuple[str, str, str]]:
    """The first three cells of each row of PROTOCOL.md's "Daemon limits" table: key, flag and default."""
    return [(f"`{s.name}`", f"`{s.flag}`", s.shown_default() or "none") for s in settings.values() if s.limit]
