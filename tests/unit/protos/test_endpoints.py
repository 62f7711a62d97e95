"""The endpoint rules client and daemon share (:mod:`cuctxd.protos.endpoints`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuctxd.protos.endpoints import (
    ENDPOINT_ENV,
    MAX_IPC_PATH,
    SOCKET_NAME,
    BadEndpoint,
    check_endpoint,
    client_endpoint,
)


@pytest.mark.parametrize("url", ["ipc:///tmp/x/d.sock", "ipc://@abstract", "tcp://127.0.0.1:5555",
                                 "tcp://localhost:1", "tcp://[::1]:65535", "tcp://eth0:5555"])
def test_good_endpoints_pass_both_ways(url: str) -> None:
    assert check_endpoint(url) == url
    assert check_endpoint(url, bind=True) == url


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:*", "tcp://*:5555", "tcp://*:*"])
def test_wildcards_are_for_binding(url: str) -> None:
    assert check_endpoint(url, bind=True) == url
    with pytest.raises(BadEndpoint):
        check_endpoint(url)


@pytest.mark.parametrize(("url", "says"), [
    ("/tmp/x.sock", "write ipc:///tmp/x.sock"),
    ("localhost:5555", "write tcp://localhost:5555"),
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("tcp://:5555", "needs a host and a port"),
    ("tcp://[::1", "needs a host and a port"),
    ("tcp://127.0.0.1:0", "1..65535"),
    ("tcp://127.0.0.1:65536", "1..65535"),
    ("tcp://127.0.0.1:http", "1..65535"),
    ("http://127.0.0.1:8080/", "not http://"),
    ("ipc://", "names no socket path"),
    ("ipc:///" + "x" * MAX_IPC_PATH, f"more than the {MAX_IPC_PATH}"),
    ("", "non-empty"),
])
def test_bad_endpoints_say_what_to_write(url: str, says: str) -> None:
    for bind in (False, True):
        with pytest.raises(BadEndpoint) as error:
            check_endpoint(url, bind=bind)
        assert says in str(error.value)
    assert isinstance(error.value, ValueError)  # the config checks catch ValueError


def test_a_client_tries_the_argument_the_environment_its_own_socket_then_the_system_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, system = tmp_path / "runtime", tmp_path / "run" / SOCKET_NAME
    runtime.mkdir()
    system.parent.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    own = f"ipc://{runtime / 'cuctxd' / SOCKET_NAME}"
    assert client_endpoint(system_socket=str(system)) == own  # neither exists: the user's, named in the error
    system.touch()
    assert client_endpoint(system_socket=str(system)) == f"ipc://{system}"  # the shipped unit's socket
    (runtime / "cuctxd").mkdir()
    (runtime / "cuctxd" / SOCKET_NAME).touch()
    assert client_endpoint(system_socket=str(system)) == own  # the user's own daemon first
    monkeypatch.setenv(ENDPOINT_ENV, "tcp://127.0.0.1:5555")
    assert client_endpoint(system_socket=str(system)) == "tcp://127.0.0.1:5555"
    assert client_endpoint("ipc:///tmp/x.sock", system_socket=str(system)) == "ipc:///tmp/x.sock"
