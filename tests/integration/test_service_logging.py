"""The daemon's log: text by default, JSON lines with --log-format json; one line per session event."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.client import Client, UnknownHandle
from tests.helpers import DaemonProcess, remove_tempdir, running_daemon, start_daemon, wait_for_log


@pytest.fixture(scope="module")
def json_daemon() -> Iterator[DaemonProcess]:
    process = start_daemon("--sim-devices", "1", "--sim-memory", "16MiB", "--log-format", "json",
                           "--log-level", "DEBUG", "--lease-ttl", "0.5")
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, process.log()


def records(process: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in process.log().splitlines()]


def wait_for_record(process: DaemonProcess, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for record in records(process):
            if all(v.search(str(record.get(k))) if isinstance(v, re.Pattern) else record.get(k) == v
                   for k, v in fields.items()):
                return record
        if time.monotonic() > deadline:
            raise AssertionError(f"no log record with {fields}:\n{process.log()}")
        time.sleep(0.02)


def test_every_line_is_a_json_object_with_the_standard_fields(json_daemon: DaemonProcess) -> None:
    with Client(json_daemon.endpoint, timeout=10) as client:
        client.ping()
    wait_for_record(json_daemon, logger="cuctxd.daemon.sessions")
    lines = records(json_daemon)
    assert lines
    for line in lines:
        assert {"ts", "level", "logger", "thread", "message"} <= set(line)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line["ts"])


def test_session_open_and_close_are_info_lines_with_fields(json_daemon: DaemonProcess) -> None:
    with Client(json_daemon.endpoint, timeout=10, name="log-test") as client:
        session = client.session_id
    opened = wait_for_record(json_daemon, session=session, logger="cuctxd.daemon.sessions", level="INFO",
                             message=f"session {session} opened by log-test (pid {os.getpid()})")
    assert opened["client"] == "log-test"
    closed = wait_for_record(json_daemon, session=session, logger="cuctxd.daemon.sessions", level="INFO",
                             message=re.compile(rf"session {session} \(log-test, pid \d+\) closed after "))
    assert isinstance(closed["lived_s"], float)


def test_a_reap_is_logged(json_daemon: DaemonProcess) -> None:
    client = Client(json_daemon.endpoint, timeout=10, heartbeat=False, name="forgotten")
    try:
        session = client.session_id
        wait_for_record(json_daemon, level="INFO",
                        message=f"session {session} (forgotten, pid {os.getpid()}) reaped: no request or "
                                "heartbeat for 0.5 s")
    finally:
        client.close()


def test_errors_warn_and_requests_are_debug_lines(json_daemon: DaemonProcess) -> None:
    with Client(json_daemon.endpoint, timeout=10) as client:
        buffer = client.alloc(4096)
        buffer.free()
        with pytest.raises(UnknownHandle):
            client.free(type(buffer)(client, buffer.record))  # the same Buffer object again would be a no-op
    failed = wait_for_record(json_daemon, level="WARNING", op="free", outcome="CUCTXD_ERROR_UNKNOWN_HANDLE")
    assert failed["latency_ms"] >= 0
    ok = wait_for_record(json_daemon, level="DEBUG", op="alloc", outcome="ok")
    assert ok["logger"] == "cuctxd.daemon.requests"


def test_text_is_the_default() -> None:
    with running_daemon("--sim-devices", "1", "--sim-memory", "16MiB") as process:
        with Client(process.endpoint, timeout=10, name="text-test") as client:
            session = client.session_id
        wait_for_log(process, re.escape(f"session {session} (text-test"))
    line = next(line for line in process.log().splitlines() if f"session {session} opened by text-test" in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO cuctxd.daemon.sessions \[MainThread\] ", line), line
    assert not process.log().lstrip().startswith("{")

