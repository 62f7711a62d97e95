"""Units of the security work: key loading, peers, per-peer session counts, per-session object limits."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path

import pytest
import zmq

from cuctxd.client.wire.socket_transport import CurveKeys, curve_keys
from cuctxd.client.wire.transport import no_reply
from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.intake.peers import peer_of, peer_or_pid
from cuctxd.daemon.registry.sessions import SessionRef, SessionRegistry
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.daemon.service.endpoint import open_ipc_socket, prepare_ipc
from cuctxd.daemon.service.keygen import write_key_pair
from cuctxd.protos.errors import LimitExceeded


def test_write_key_pair_and_load_it_back(tmp_path: Path) -> None:
    public_file, secret_file, public = write_key_pair(tmp_path / "keys", "alice")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    server_pub, _, _ = write_key_pair(tmp_path / "keys", "server")
    keys = CurveKeys.load(server_pub, secret_file)
    assert keys.public.decode() == public and len(keys.secret) == 40
    with pytest.raises(FileExistsError):
        write_key_pair(tmp_path / "keys", "alice")
    with pytest.raises(ValueError, match="no secret key"):
        CurveKeys.load(server_pub, public_file)
    with pytest.raises(ValueError, match="server_key"):
        CurveKeys.load(tmp_path / "missing.key", secret_file)
    with pytest.raises(ValueError, match="needs server_key"):
        curve_keys(None, secret_file)
    assert curve_keys(None, None) is None
    assert curve_keys(keys, None) is keys


def test_a_curve_timeout_points_at_the_keys() -> None:
    assert "allow_dir" not in str(no_reply("tcp://h:1", 2, "hello"))
    assert "allow_dir" in str(no_reply("tcp://h:1", 2, "hello", curve=True))


def test_peer_of_a_plain_inproc_frame_is_unknown_and_falls_back_to_the_pid() -> None:
    context = zmq.Context()
    try:
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        pull.bind("inproc://peers-test")
        push.connect("inproc://peers-test")
        push.send(b"x")
        frame = pull.recv(copy=False)
        assert peer_of(frame) is None
        assert peer_or_pid(peer_of(frame), 42) == "pid:42"
        assert peer_or_pid("key:abc", 42) == "key:abc"
        push.close()
        pull.close()
    finally:
        context.term()


def test_sessions_are_counted_per_peer() -> None:
    sessions = SessionRegistry()
    a = sessions.open("c", 1, "key:a")
    sessions.open("c", 2, "key:a")
    sessions.open("c", 3, "key:b")
    assert sessions.count_peer("key:a") == 2 and sessions.count_peer("key:b") == 1
    sessions.close(a.ref.token)
    assert sessions.count_peer("key:a") == 1


def test_object_limit_counts_every_kind_and_spares_the_primary() -> None:
    driver = SimDriver(device_count=1, memory_per_device=1 << 20)
    driver.init()
    state = DeviceState(driver, 0, driver.device_info(0), DeviceLimits(4096, max_objects_per_session=2),
                        ShareRegistry(), TicketBook())
    session = state.session(SessionRef("t", 1, "unit", 1))
    state.contexts.set_device(session)  # the primary is not counted
    state.memory.alloc(session, state.contexts.for_new(session, "buffer"), 64, False)
    state.streams.create_stream(session, state.contexts.for_new(session, "stream"), False)
    with pytest.raises(LimitExceeded, match="max_objects_per_session"):
        state.streams.create_event(session, state.contexts.for_new(session, "event"), True)
    with pytest.raises(LimitExceeded, match="context"):
        state.contexts.create(session, 0)
    state.close_session(session.ref)


def test_group_mode_of_the_ipc_directory_and_socket(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    path = tmp_path / "cuctxd-g" / "d.sock"
    prepare_ipc(path, group)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o770
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        open_ipc_socket(path, group)
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        open_ipc_socket(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        server.close()
