"""Fixtures shared by every test level."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cuctxd.client import Client
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A real sim-backed cuctxd (2 devices, 64 MiB each) shared by a test module."""
    process = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB")
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()}"


@pytest.fixture
def stop_after() -> Iterator[list[DaemonProcess]]:
    """Daemons a test starts itself: append each; all are stopped afterwards and must exit 0."""
    started: list[DaemonProcess] = []
    yield started
    for process in started:
        code = process.stop()
        remove_tempdir(process.socket_dir)
        assert code == 0, process.log()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    """A fresh session: like a new host thread, it starts with no context."""
    with Client(daemon.endpoint, timeout=10) as session:
        yield session


#: The two ways a client can reach device ops: each device's own endpoint (the default), or the main one.
ROUTES = {"device endpoints": True, "main endpoint only": False}


@pytest.fixture(params=list(ROUTES))
def routed_client(request: pytest.FixtureRequest, daemon: DaemonProcess) -> Iterator[Client]:
    """:func:`client`, once per route: modules whose ops must behave the same both ways use it as ``client``."""
    with Client(daemon.endpoint, timeout=10, device_endpoints=ROUTES[request.param]) as session:
        yield session
