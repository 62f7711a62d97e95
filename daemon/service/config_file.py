"""The ``--config`` TOML file: its keys, how each value is checked, and ``--print-config``.

Keys mirror the long command-line flags in snake_case (``--sim-memory`` is
``sim_memory``). One :class:`Key` per setting holds the check that both the
file and the command line go through, so a value means the same wherever it
comes from. Precedence: built-in defaults, then the file, then flags.
"""

from __future__ import annotations

import difflib
import grp
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cuctxd.daemon.service.config import ConfigError, DaemonConfig, format_size, parse_size
from cuctxd.protos import endpoints
from cuctxd.protos.cuda_results import CUresult

#: Most devices the sim backend can simulate (its own limit, repeated so checking needs no backend import).
_MAX_SIM_DEVICES = 16
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Key:
    """One setting: ``check`` turns a TOML-typed value into the stored one or raises ValueError;
    ``from_text`` turns a command-line string into a TOML-typed value; ``render`` goes back."""

    name: str
    check: Callable[[Any], Any]
    from_text: Callable[[str], Any] = str
    render: Callable[[Any], Any] = lambda value: value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) else kind


def _integer(low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {_show(value)}")
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise ValueError(f"must be {bound}, got {value}")
        return value
    return check


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number of seconds, got {_show(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be a positive number of seconds, got {value}")
    return float(value)


def _size(minimum: int = 0) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        size = parse_size(value)
        if size < minimum:
            raise ValueError(f"must be at least {minimum} bytes, got {value!r}")
        return size
    return check


def _choice(*choices: str, fold: Callable[[str], str] = str.lower) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str) or fold(value) not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return fold(value)
    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {_show(value)}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {_show(value)}")
    return value


def check_endpoint(value: Any) -> str:
    """An endpoint the daemon can bind (the rules shared with clients: :mod:`cuctxd.protos.endpoints`)."""
    return endpoints.check_endpoint(value, bind=True)


def _endpoints(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty array of URLs, got {_show(value)}")
    return tuple(check_endpoint(v) for v in value)


def _ordinals(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty array of device ordinals, got {_show(value)}")
    ordinals = tuple(_integer(0)(v) for v in value)
    if len(set(ordinals)) != len(ordinals):
        raise ValueError(f"lists a device twice: {list(ordinals)}")
    return ordinals


def _ordinals_text(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"not a comma-separated list of device ordinals: {text!r} (e.g. 0,2)") from None


def _path(kind: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        path = Path(_string(value)).expanduser()
        if kind == "file" and not path.is_file():
            raise ValueError(f"{str(path)!r} is not a readable file")
        if kind == "dir" and not path.is_dir():
            raise ValueError(f"{str(path)!r} is not a directory")
        return os.path.abspath(path)
    return check


def _group(value: Any) -> str:
    name = _string(value)
    try:
        grp.getgrgid(int(name)) if name.isdigit() else grp.getgrnam(name)
    except KeyError:
        raise ValueError(f"no such group: {name!r}") from None
    return name


def _sim_fault(value: Any) -> str:
    """``DEVICE:AFTER_CALLS:CUDA_ERROR_NAME``: a sim-only fault injection for testing."""
    text = _string(value)
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in CUresult.__members__:
        raise ValueError(f"{text!r} is not DEVICE:AFTER_CALLS:CUDA_ERROR_NAME (e.g. 1:40:CUDA_ERROR_ILLEGAL_ADDRESS)")
    return text


def _int_text(text: str) -> int:
    return int(text)


def _number_text(text: str) -> float:
    return float(text)


def _size_render(value: int) -> str | int:
    return format_size(value)


KEYS: dict[str, Key] = {key.name: key for key in (
    Key("endpoints", _endpoints, render=list),
    Key("backend", _choice("auto", "cuda", "sim")),
    Key("sim_devices", _integer(1, _MAX_SIM_DEVICES), _int_text),
    Key("sim_memory", _size(1), render=_size_render),
    Key("devices", _ordinals, _ordinals_text, render=list),
    Key("max_payload", _size(1), render=_size_render),
    Key("lease_ttl", _seconds, _number_text),
    Key("session_quota", _size(), render=_size_render),
    Key("device_reserve", _size(), render=_size_render),
    Key("drain_timeout", _seconds, _number_text),
    Key("log_level", _choice(*_LOG_LEVELS, fold=str.upper)),
    Key("log_format", _choice("text", "json")),
    Key("metrics_port", _integer(0, 65535), _int_text),
    Key("metrics_host", _string),
    Key("group", _group),
    Key("insecure_tcp", _boolean),
    Key("server_key", _path("file")),
    Key("allow_dir", _path("dir")),
    Key("max_sessions_per_peer", _integer(0), _int_text),
    Key("max_objects_per_session", _integer(0), _int_text),
    Key("orphan_ttl", _seconds, _number_text),
    Key("sim_fault", _sim_fault),
    Key("device_endpoints", _boolean),
    Key("max_queued_requests", _integer(0), _int_text),
    Key("max_queued_bytes", _size(), render=_size_render),
    Key("max_reply_bytes", _size(), render=_size_render),
    Key("max_contexts_per_session", _integer(0), _int_text),
    Key("max_shares_per_session", _integer(0), _int_text),
    Key("max_orphaned_shares", _integer(0), _int_text),
    Key("max_connections", _integer(0), _int_text),
    Key("handshake_timeout", _seconds, _number_text),
    Key("host_memory_per_session", _size(), render=_size_render),
    Key("max_host_memory", _size(), render=_size_render),
    Key("max_fd_connections", _integer(0), _int_text),
    Key("fd_ticket_ttl", _seconds, _number_text),
    Key("max_tickets_per_session", _integer(0), _int_text),
    Key("max_shm_lanes", _integer(0), _int_text),
    Key("busy_poll_us", _integer(0, 1_000_000), _int_text),
    Key("max_client_fds", _integer(0), _int_text),
    Key("max_client_fds_per_peer", _integer(0), _int_text),
    Key("max_client_fds_per_session", _integer(0), _int_text),
    Key("max_fd_connections_per_peer", _integer(0), _int_text),
    Key("max_sessions_per_uid", _integer(0), _int_text),
    Key("max_orphaned_bytes_per_uid", _size(), render=_size_render),
    Key("max_manifest_bytes_per_session", _size(), render=_size_render),
    Key("max_manifest_bytes_per_uid", _size(), render=_size_render),
    Key("max_reply_bytes_per_peer", _size(), render=_size_render),
    Key("node_name", _string),
)}

assert set(KEYS) == {f.name for f in fields(DaemonConfig)}, "every DaemonConfig field has a key"


def check_value(name: str, value: Any, source: str | None = None) -> Any:
    """The stored form of ``value`` for key ``name``; :class:`ConfigError` naming the key if it is bad."""
    key = KEYS.get(name)
    if key is None:
        close = difflib.get_close_matches(name, KEYS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(KEYS)}"
        raise ConfigError(name, f"unknown key{hint}", source)
    try:
        return key.check(value)
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
    for field in fields(DaemonConfig):
        value = getattr(config, field.name)
        if value is None:
            lines.append(f"# {field.name} is not set")
            continue
        lines.append(f"{field.name} = {_toml_value(KEYS[field.name].render(value))}")
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
