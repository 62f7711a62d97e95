"""The processes of ``test_fd_budget``: module-level so that ``spawn`` can import them (pytest runs in
importlib mode, so a target defined in a test module could not be found by the child).

Each is one peer of the daemon (a process of the daemon's user). It reports on a pipe, then holds what it
took until the test sends anything on the pipe (or closes it), and lets go of everything on its way out.
"""

from __future__ import annotations

import contextlib
import socket
import time
from multiprocessing.connection import Connection

from cuctxd import Client
from cuctxd.client.wire import build
from cuctxd.client.wire.fd_channel import FdChannel
from cuctxd.protos.errors import CuctxError, LimitExceeded

#: Most tickets one session asks for (far more than any share allows).
MOST_TICKETS = 1000
#: Seconds an attacker keeps trying to open its connections.
CONNECT_WITHIN = 20.0
#: Host buffers of this size: the smallest page.
HOST_SIZE = 4096


def hoard_tickets(endpoint: str, sessions: int, results: Connection) -> None:
    """Open ``sessions`` sessions; each takes as many ``host_alloc`` tickets as the daemon gives and redeems
    none. Reports ``[(tickets, refusal message), ...]``, one per session, then holds them."""
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client(endpoint, timeout=30, name=f"hoarder-{n}")) for n in range(sessions)]
        report: list[tuple[int, str | None]] = []
        for client in clients:
            taken, refusal = 0, None
            while taken < MOST_TICKETS:
                try:
                    client.run(build.host_alloc(0, HOST_SIZE))
                except LimitExceeded as refused:
                    refusal = refused.message
                    break
                taken += 1
            report.append((taken, refusal))
        results.send(report)
        with contextlib.suppress(EOFError):
            results.recv()


def hold_fd_connections(path: str, attempts: int, results: Connection) -> None:
    """Open ``attempts`` connections to the fd channel at ``path`` and keep every one the daemon keeps.
    Reports how many connected; once told (the daemon has taken or refused them all), ``(kept, refusal
    message)``: the daemon's answer on a connection it refused, if any. Then, until told to let go, it
    re-fills: every connection the daemon closes (refused, or silent past ``handshake_timeout``) is
    opened again."""
    opened: list[socket.socket] = []
    try:
        _open(path, opened, attempts, time.monotonic() + CONNECT_WITHIN)
        results.send(len(opened))
        results.recv()
        refusal = None
        for sock in [sock for sock in opened if not _held(sock)]:
            opened.remove(sock)
            if refusal is None:
                sock.settimeout(5)
                try:
                    FdChannel._receive(sock)
                except CuctxError as error:
                    refusal = f"{error.name}: {error.message}"
                except (OSError, EOFError):
                    pass
            sock.close()
        results.send((len(opened), refusal))
        while not results.poll(0.02):
            for sock in [sock for sock in opened if not _held(sock)]:
                opened.remove(sock)
                sock.close()
            _open(path, opened, attempts, time.monotonic() + 0.05)
    except EOFError:
        pass
    finally:
        for sock in opened:
            sock.close()


def _open(path: str, opened: list[socket.socket], attempts: int, deadline: float) -> None:
    """Connect until ``opened`` holds ``attempts`` connections or ``deadline`` passes."""
    while len(opened) < attempts and time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(path)
        except BlockingIOError:  # the listen backlog is full: the daemon has yet to accept
            sock.close()
            time.sleep(0.001)
            continue
        sock.setblocking(False)
        opened.append(sock)


def _held(sock: socket.socket) -> bool:
    """Whether the daemon still holds the connection: open, and nothing said on it (a refusal says why)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def data_plane_clients(endpoint: str, clients: int, results: Connection) -> None:
    """``clients`` fresh sessions, each with its data plane: a ``host_alloc`` (its fd over the fd channel,
    mapped here), and a 64 KiB write through the staging ring, read back. Reports the errors, by name."""
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        for n in range(clients):
            try:
                client = stack.enter_context(Client(endpoint, timeout=30, name=f"fresh-{n}"))
                host = client.host_alloc(HOST_SIZE)
                host.free()
                data = bytes(range(256)) * 256
                buffer = client.alloc(len(data))
                client.write(buffer, data)
                if client.read(buffer) != data:
                    errors.append("mismatch")
            except CuctxError as error:
                errors.append(f"{error.name}: {error.message}")
    results.send(errors)


def allocate_shareable(endpoint: str, count: int, results: Connection) -> None:
    """One session allocates ``count`` shareable 4 KiB buffers, stopping at the first refusal, and opens the first
    one from a second session through its fd (an import, as a consumer's). Reports ``(allocated, refusal message,
    the opened bytes)``, then holds them."""
    with Client(endpoint, timeout=30, name="shareable") as client, Client(endpoint, timeout=30) as consumer:
        buffers, refusal = [], None
        while len(buffers) < count:
            try:
                buffers.append(client.alloc(HOST_SIZE, shareable=True))
            except LimitExceeded as refused:
                refusal = refused.message
                break
        buffers[0].write(b"first")
        with consumer.open_shared(client.export(buffers[0])) as share:
            opened = bytes(share.host_view()[:5])
        results.send((len(buffers), refusal, opened))
        with contextlib.suppress(EOFError):
            results.recv()
