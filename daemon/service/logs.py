"""The daemon's log output: human text (default) or one JSON object per line (``log_format = "json"``).

A JSON line carries ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``thread``
and ``message``, then every ``extra=`` field the call passed (``session``,
``op``, ``outcome``, ``latency_ms`` ...), and ``exc`` with the traceback when
there is one. Everything goes to stderr: systemd's journal picks it up there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


#: Characters a text log line must not carry as they are: line breaks (which would start a forged line), terminal
#: controls (ANSI escapes that rewrite what an operator sees), and every other character Python does not call
#: printable: bidi overrides and zero-width characters (Unicode's format characters, such as U+202E, which
#: reorders what a terminal shows, and U+200B), separators other than the space, surrogates, unassigned code
#: points. Client-supplied strings (client names, share names, error messages) reach log messages, so every
#: message is escaped (a newline as backslash-n, U+202E as backslash-u202e).
_NAMED = {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def _escaped(char: str) -> str:
    code = ord(char)
    if code in _NAMED:
        return _NAMED[code]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str) -> str:
    """``text`` with line breaks, controls and other non-printable characters written as escapes: one log line
    stays one line, and shows what was sent."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT` lines whose message is escaped (:func:`escape_controls`); tracebacks stay as they are."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return TEXT_FORMAT % {**vars(record), "message": escape_controls(record.message)}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; values JSON cannot hold are written as their ``str()``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def setup_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Replace the root logger's handlers with one writing ``log_format`` at ``level`` to ``stream``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def flush_logs() -> None:
    """Flush every root handler (before an ``os._exit``, which skips logging's own shutdown)."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(OSError, ValueError):
            handler.flush()
