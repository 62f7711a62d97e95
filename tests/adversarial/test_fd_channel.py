"""A hostile local process against the fd channel: garbage, wrong and replayed tickets, silence, floods.
Each runs against a real daemon process; its other sessions (the bystander) must not notice."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from cuctxd import Client, NotFound
from cuctxd.client.wire.fd_channel import FdChannel
from cuctxd.protos.fd_channel import REQUEST_MAGIC, TICKET_BYTES, encode_request, reply_length
from tests.adversarial.attacks import Bystander
from tests.helpers import DaemonProcess, wait_for_log, wait_until

HANDSHAKE = 1.0


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    return ("--handshake-timeout", str(HANDSHAKE), "--max-fd-connections", "8", "--fd-ticket-ttl", "2",
            "--max-tickets-per-session", "4")


@pytest.fixture
def channel_path(attack_daemon: DaemonProcess) -> str:
    return attack_daemon.endpoint[len("ipc://"):] + ".fds"


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def closed_by_daemon(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the daemon closed the connection (EOF, or a reset: it closed with our bytes unread)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def fd_count(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def channel_stats(client: Client) -> dict[str, int]:
    stats: dict[str, int] = client.status()["fd_channel"]
    return stats


@pytest.fixture
def host_ticket(attack_daemon: DaemonProcess) -> Iterator[tuple[Client, str]]:
    """A session and a host buffer's ticket it has not redeemed (a raw request, not the client's plan)."""
    from cuctxd.client.wire import build

    with Client(attack_daemon.endpoint, timeout=10) as client:
        result = client.run(build.host_alloc(0, 4096))
        yield client, result["ticket"]


def test_garbage_is_dropped_and_logged(attack_daemon: DaemonProcess, channel_path: str,
                                       bystander: Bystander) -> None:
    with connect(channel_path) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        assert closed_by_daemon(sock)
    wait_for_log(attack_daemon, r"fd channel: dropped a connection of pid \d+ uid \d+: it sent something that is "
                                r"not an fd channel request")
    bystander.check()


def test_a_wrong_ticket_is_refused_then_the_right_one_still_works(host_ticket: tuple[Client, str],
                                                                  channel_path: str) -> None:
    client, ticket = host_ticket
    wrong = ticket[:-2] + ("00" if ticket[-2:] != "00" else "11")
    with pytest.raises(NotFound):
        FdChannel(channel_path, 5).fetch(wrong)  # right id, wrong secret: the ticket is void now
    with pytest.raises(NotFound):
        FdChannel(channel_path, 5).fetch(ticket)
    unknown = os.urandom(TICKET_BYTES).hex()
    with pytest.raises(NotFound):
        FdChannel(channel_path, 5).fetch(unknown)
    assert channel_stats(client)["tickets"] == 0


def test_a_ticket_redeems_once(host_ticket: tuple[Client, str], channel_path: str) -> None:
    _, ticket = host_ticket
    channel = FdChannel(channel_path, 5)
    fds, info = channel.fetch(ticket)
    try:
        assert len(fds) == 1 and os.fstat(fds[0]).st_size == 4096 and "host" in info
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(NotFound):
        channel.fetch(ticket)  # a replay
    channel.close()


def test_silence_is_dropped_after_the_handshake_timeout(attack_daemon: DaemonProcess, channel_path: str,
                                                        bystander: Bystander) -> None:
    started = time.monotonic()
    with connect(channel_path) as silent, connect(channel_path) as partial:
        partial.sendall(REQUEST_MAGIC + b"\0" * 5)
        assert closed_by_daemon(silent, timeout=HANDSHAKE + 5)
        assert closed_by_daemon(partial, timeout=HANDSHAKE + 5)
    assert time.monotonic() - started < HANDSHAKE + 3
    wait_for_log(attack_daemon, "sent nothing within handshake_timeout")
    wait_for_log(attack_daemon, "did not complete its request within handshake_timeout")
    bystander.check()


def test_a_connection_flood_is_capped_and_holds_nothing(attack_daemon: DaemonProcess, channel_path: str,
                                                        bystander: Bystander) -> None:
    with Client(attack_daemon.endpoint, timeout=10) as observer:
        before = fd_count(attack_daemon)
        flood = [connect(channel_path) for _ in range(40)]
        try:
            assert wait_until(lambda: channel_stats(observer)["connections"] == 8, timeout=5)
            assert fd_count(attack_daemon) <= before + 8 + 2
            host = observer.host_alloc(4096)  # a full channel: the client's own fetch must wait or fail, not hang
        except Exception as refused:
            host = None
            assert "fd channel" in str(refused)
        finally:
            for sock in flood:
                sock.close()
        assert wait_until(lambda: channel_stats(observer)["connections"] <= 1, timeout=HANDSHAKE + 5)
        if host is not None:
            host.free()
        observer.host_alloc(4096).free()  # and it serves again
    wait_for_log(attack_daemon, r"fd channel: refusing new connections: max_fd_connections: ")
    bystander.check()


def test_unredeemed_tickets_expire_and_their_fds_close(attack_daemon: DaemonProcess,
                                                       host_ticket: tuple[Client, str], channel_path: str) -> None:
    client, ticket = host_ticket
    assert channel_stats(client)["fds"] == 1
    assert wait_until(lambda: channel_stats(client)["fds"] == 0, timeout=6)
    with pytest.raises(NotFound):
        FdChannel(channel_path, 5).fetch(ticket)


def test_tickets_waiting_per_session_are_bounded(attack_daemon: DaemonProcess) -> None:
    from cuctxd.client import LimitExceeded
    from cuctxd.client.wire import build

    with Client(attack_daemon.endpoint, timeout=10) as client:
        for _ in range(4):
            client.run(build.host_alloc(0, 4096))
        with pytest.raises(LimitExceeded, match="max_tickets_per_session"):
            client.run(build.host_alloc(0, 4096))
        assert client.status()["devices"][0]["host_bytes"] == 4 * 4096  # the refused one holds nothing
    with Client(attack_daemon.endpoint, timeout=10) as client:
        assert channel_stats(client)["tickets"] == 0  # the session's tickets went with it


def test_a_request_split_into_single_bytes_still_redeems(host_ticket: tuple[Client, str], channel_path: str) -> None:
    _, ticket = host_ticket
    with connect(channel_path) as sock:
        for byte in encode_request(ticket):
            sock.send(bytes([byte]))
        header, fds, _, _ = socket.recv_fds(sock, 4, 4)
        try:
            assert len(fds) == 1 and reply_length(header) > 0
        finally:
            for fd in fds:
                os.close(fd)
