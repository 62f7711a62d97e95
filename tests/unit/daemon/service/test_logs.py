"""The text log's escaping: one log line stays one line, and shows every character a client sent."""

from __future__ import annotations

import logging

import pytest

from cuctxd.daemon.service.logs import TextFormatter, escape_controls


@pytest.mark.parametrize(("text", "escaped"), [
    ("plain text, caf\u00e9, \u6a21\u578b", "plain text, caf\u00e9, \u6a21\u578b"),
    ("a\nb\rc\td", "a\\nb\\rc\\td"),
    ("\x00\x1b[2J\x7f\x85", "\\x00\\x1b[2J\\x7f\\x85"),
    ("\u202eexe.txt", "\\u202eexe.txt"),  # bidi override (Cf)
    ("zero\u200bwidth\ufeff\u2066", "zero\\u200bwidth\\ufeff\\u2066"),
    ("\u2028\u2029\u00a0\u3000", "\\u2028\\u2029\\xa0\\u3000"),  # separators other than the space
    ("tag\U000e0041", "tag\\U000e0041"),
])
def test_non_printable_characters_are_escaped(text: str, escaped: str) -> None:
    assert escape_controls(text) == escaped


def test_the_text_formatter_escapes_the_message() -> None:
    record = logging.LogRecord("cuctxd.test", logging.WARNING, __file__, 1, "client %s", ("a\u202eb\nc",), None)
    line = TextFormatter().format(record)
    assert line.endswith("client a\\u202eb\\nc") and "\n" not in line
