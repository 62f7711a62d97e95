"""The seed program, through the real client against a real daemon.

The program (a CUDA runtime sample): a new host thread has no current context;
``cudaGetDeviceCount`` creates none; ``cudaSetDevice(0)`` retains the primary
context and makes it current; ``cudaGetDevice`` reads the device back.
"""

from __future__ import annotations

from typing import Any

from cuctxd.client import Client
from tests.helpers import DaemonProcess


def primary_active(status: dict[str, Any]) -> list[bool]:
    return [d["primary_context"]["active"] for d in status["devices"]]


def test_the_seed_program(client: Client) -> None:
    # Current context = nullptr: a new session has no context.
    assert client.current_context() is None

    # cudaGetDeviceCount triggers no context.
    assert client.device_count() == 2
    assert client.current_context() is None
    assert client.context_stack() == []
    assert primary_active(client.status()) == [False, False]

    # cudaSetDevice(0) binds the primary context and makes it current.
    context = client.set_device(0)
    assert context.is_primary
    assert context.device == 0
    current = client.current_context()
    assert current is not None
    assert current.handle == context.handle
    assert current.is_primary
    assert primary_active(client.status()) == [True, False]

    # cudaGetDevice reads the device back.
    assert client.get_device() == 0


def test_set_device_to_another_device_follows_the_same_rules(client: Client) -> None:
    context = client.set_device(1)
    assert client.get_device() == 1
    assert context.device == 1
    assert context.is_primary
    assert client.current_context() is not None  # device 1 is now the default device
    assert client.current_context(device=0) is None  # device 0 was never touched
    assert primary_active(client.status()) == [False, True]


def test_each_new_session_starts_like_a_new_host_thread(daemon: DaemonProcess, client: Client) -> None:
    client.set_device(1)
    with Client(daemon.endpoint, timeout=10) as fresh:
        assert fresh.get_device() == 0
        assert fresh.current_context() is None
        assert fresh.current_context(device=1) is None
        theirs = fresh.set_device(1)
        ours = client.current_context(device=1)
        assert ours is not None
        assert theirs.context_id == ours.context_id  # one primary context per device
        assert theirs.handle != ours.handle  # but each session names it with its own handle
