"""The ``--config`` TOML file: its keys, how each value is checked, and ``--print-config``.

Keys mirror the long command-line flags in snake_case (``--sim-memory`` is
``sim_memory``): one per setting of :class:`~cuctxd.daemon.service.config.DaemonConfig`,
whose declaration (:data:`~cuctxd.daemon.service.config.SETTINGS`) holds the check that
both the file and the command line go through, so a value means the same wherever it
comes from. Precedence: built-in defaults, then the file, then flags.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cuctxd.daemon.service.config import SETTINGS, ConfigError, DaemonConfig


def check_value(name: str, value: Any, source: str | None = None) -> Any:
    """The stored form of ``value`` for key ``name``; :class:`ConfigError` naming the key if it is bad."""
    declared = SETTINGS.get(name)
    if declared is None:
        close = difflib.get_close_matches(name, SETTINGS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(SETTINGS)}"
        raise ConfigError(name, f"unknown key{hint}", source)
    try:
        return declared.check(value)
    except ValueError as exc:
        raise ConfigError(name, str(exc), source) from None


def load_file(path: str | Path) -> dict[str, Any]:
    """The checked settings a TOML file makes; :class:`ConfigError` for an unreadable file or a bad key."""
    source = str(path)
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {source}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("--config", f"{source} is not valid TOML: {exc}") from None
    return {name: check_value(name, value, source) for name, value in data.items()}


def build_config(from_file: Mapping[str, Any], from_flags: Mapping[str, Any], default_endpoint: str) -> DaemonConfig:
    """Defaults, overridden by the file, overridden by flags (all already checked)."""
    values: dict[str, Any] = {"endpoints": (default_endpoint,)}
    values.update(from_file)
    values.update(from_flags)
    return DaemonConfig(**values)


# --- --print-config --------------------------------------------------------------------


def render_toml(config: DaemonConfig) -> str:
    """``config`` as a TOML file that ``--config`` reads back to the same configuration."""
    lines = ["# cuctxd effective configuration (defaults, then --config, then flags)"]
    for name, declared in SETTINGS.items():
        value = getattr(config, name)
        if value is None:
            lines.append(f"# {name} is not set")
            continue
        lines.append(f"{name} = {_toml_value(declared.render(value))}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
