"""systemd's side of the notify protocol and its file-descriptor store, for tests.

:class:`ServiceManager` does what systemd documents for one ``Type=notify`` service:

* ``$NOTIFY_SOCKET`` is an AF_UNIX datagram socket; each datagram is ``KEY=value`` lines
  (sd_notify(3)), with file descriptors attached as ``SCM_RIGHTS`` (sd_pid_notify_with_fds(3)).
* ``FDSTORE=1`` keeps the attached fds in the store under ``FDNAME=`` (``"stored"`` without one);
  an fd already in the store (same open file) is not stored twice, as systemd's ``same_fd()`` check does.
  ``FDSTOREREMOVE=1`` with ``FDNAME=`` closes every stored fd of that name. fds attached to any
  other message are closed.
* ``$FDSTORE`` tells the service how many fds the store keeps (``FileDescriptorStoreMax=``); beyond
  it more are refused (closed).
* A (re)start passes the stored fds from fd 3 on (sd_listen_fds(3)), with ``LISTEN_FDS``,
  ``LISTEN_FDNAMES`` (colon-separated) and ``LISTEN_PID``, the new process's own pid: set by a small
  exec wrapper in the child (:data:`_EXEC_WRAPPER`), which puts the fds in place and then execs the
  daemon, keeping its pid.

The daemon runs under the same pytest process, so nothing here needs systemd or root.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import DaemonProcess, client_env, launch_daemon, remove_tempdir, short_tempdir

#: Run in the child between fork and the daemon: move the fds listed in ``CUCTXD_TEST_LISTEN_FDS``
#: (in order) to 3, 4, ..., set ``LISTEN_PID`` to this pid (exec keeps it), then exec the daemon.
_EXEC_WRAPPER = """
import fcntl, os, sys
sources = [int(fd) for fd in os.environ.pop("CUCTXD_TEST_LISTEN_FDS", "").split(",") if fd]
moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3 + len(sources)) for fd in sources]
for fd in sources:
    os.close(fd)
for index, fd in enumerate(moved):
    os.dup2(fd, 3 + index, inheritable=True)
    os.close(fd)
if sources:
    os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


@dataclass
class StoredFd:
    name: str
    fd: int


@dataclass
class ServiceManager:
    """One service's notify socket, fd store and process; :meth:`close` ends all three."""

    workdir: Path
    #: ``FileDescriptorStoreMax=``: the most fds the store keeps.
    store_max: int = 64
    messages: list[dict[str, str]] = field(default_factory=list)
    store: list[StoredFd] = field(default_factory=list)
    #: The store's history: ("store" | "remove" | "refused", name), in order.
    events: list[tuple[str, str]] = field(default_factory=list)
    daemon: DaemonProcess | None = None

    def __post_init__(self) -> None:
        self.address = str(self.workdir / "notify")
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.address)
        self._lock = threading.Condition()
        self._sync = 0
        self._synced = 0
        self._quit = False
        self._thread = threading.Thread(target=self._receive, name="service-manager", daemon=True)
        self._thread.start()

    # --- the notify socket ------------------------------------------------------------

    def _receive(self) -> None:
        fd_room = socket.CMSG_SPACE(253 * 4)
        while True:
            try:
                data, ancillary, _, _ = self.socket.recvmsg(65536, fd_room)
            except OSError:
                return
            fds = array.array("i")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            message = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
            with self._lock:
                self._handle(message, list(fds))
                self._lock.notify_all()
                if self._quit:
                    return

    def _handle(self, message: dict[str, str], fds: list[int]) -> None:
        if "X-TEST-QUIT" in message:
            self._quit = True
            return
        if "X-TEST-SYNC" in message:
            self._synced = int(message["X-TEST-SYNC"])
            return
        self.messages.append(message)
        name = message.get("FDNAME", "stored")
        if message.get("FDSTOREREMOVE") == "1":
            for stored in [s for s in self.store if s.name == name]:
                os.close(stored.fd)
                self.store.remove(stored)
            self.events.append(("remove", name))
        if message.get("FDSTORE") == "1":
            for fd in fds:
                if any(_same_file(fd, s.fd) for s in self.store):
                    os.close(fd)
                elif len(self.store) >= self.store_max:
                    os.close(fd)
                    self.events.append(("refused", name))
                else:
                    self.store.append(StoredFd(name, fd))
                    self.events.append(("store", name))
        else:
            for fd in fds:
                os.close(fd)

    def sync(self, timeout: float = 10.0) -> None:
        """Return once every datagram sent before this call has been handled (they arrive in order)."""
        with self._lock:
            self._sync += 1
            mark = self._sync
        self._send_self(f"X-TEST-SYNC={mark}")
        with self._lock:
            if not self._lock.wait_for(lambda: self._synced >= mark, timeout):
                raise AssertionError("the service manager's socket did not drain")

    def _send_self(self, line: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(line.encode(), self.address)

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float = 20.0) -> dict[str, str]:
        """The first message (already received or to come) for which ``predicate`` holds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for message in self.messages:
                    if predicate(message):
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such message within {timeout} s; got {self.messages}")
                self._lock.wait(left)

    def names(self) -> list[str]:
        """The names of the stored fds, in store order."""
        self.sync()
        with self._lock:
            return [stored.name for stored in self.store]

    def add(self, name: str, fd: int) -> None:
        """Put an fd in the store as if the service had sent it (the store owns ``fd`` from now on)."""
        with self._lock:
            self.store.append(StoredFd(name, fd))

    def take(self, name: str) -> list[int]:
        """Remove the fds stored as ``name`` from the store and give them to the caller."""
        self.sync()
        with self._lock:
            taken = [s for s in self.store if s.name == name]
            for stored in taken:
                self.store.remove(stored)
        return [stored.fd for stored in taken]

    # --- the service --------------------------------------------------------------------

    def start(self, *extra: str, endpoint: str | None = None, backend: str = "sim",
              ready_timeout: float = 30.0, launcher: Sequence[str] = ()) -> DaemonProcess:
        """Start the daemon with ``NOTIFY_SOCKET``, ``FDSTORE`` and whatever the store holds from fd 3 on;
        returns once it listens. ``launcher``: Python's arguments before ``-m cuctxd.daemon`` (a wrapper that
        holds the start, as tests/reliability/restarts.py does)."""
        self.sync()
        with self._lock:
            stored = list(self.store)
        env = dict(client_env(), NOTIFY_SOCKET=self.address, FDSTORE=str(self.store_max))
        for key in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            env.pop(key, None)
        if stored:
            env.update(LISTEN_FDS=str(len(stored)), LISTEN_FDNAMES=":".join(s.name for s in stored),
                       CUCTXD_TEST_LISTEN_FDS=",".join(str(s.fd) for s in stored))
        self.daemon = launch_daemon([sys.executable, "-c", _EXEC_WRAPPER, *launcher], *extra, endpoint=endpoint,
                                    env=env, pass_fds=tuple(s.fd for s in stored), backend=backend,
                                    ready_timeout=ready_timeout)
        return self.daemon

    def kill(self) -> None:
        """SIGKILL the daemon and wait for it; every datagram it sent is handled before this returns."""
        daemon = self.daemon
        assert daemon is not None
        if daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(20)
        daemon.close_pipes()
        self.sync()

    def restart(self, *extra: str, backend: str = "sim", ready_timeout: float = 30.0) -> DaemonProcess:
        """SIGKILL the daemon (as a crash or an OOM kill would) and start it again on the same endpoint
        with the stored fds."""
        daemon = self.daemon
        assert daemon is not None
        self.kill()
        return self.start(*extra, endpoint=daemon.endpoint, backend=backend, ready_timeout=ready_timeout)

    def close(self, timeout: float = 20.0) -> int | None:
        """Stop the daemon (SIGTERM; its exit code), close the socket and every stored fd."""
        code = None
        if self.daemon is not None:
            code = self.daemon.stop(timeout)
        self._send_self("X-TEST-QUIT=1")
        self._thread.join(5)
        self.socket.close()
        with self._lock:
            for stored in self.store:
                os.close(stored.fd)
            self.store.clear()
        return code


def _same_file(a: int, b: int) -> bool:
    """Whether two fds are one open file, as systemd's ``same_fd()`` tells with ``kcmp(KCMP_FILE)``: the same
    inode, except for character devices, where one inode is every open of the device (CUDA's exported pool
    and VMM fds are all opens of ``/dev/nvidiactl``), so those are taken as different files."""
    first, second = os.fstat(a), os.fstat(b)
    if stat.S_ISCHR(first.st_mode):
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


@contextmanager
def managed(store_max: int = 64) -> Iterator[ServiceManager]:
    """A service manager in a short temporary directory; on leaving, the daemon stopped (it must exit cleanly:
    the assertion carries its log) and the directory removed."""
    directory = short_tempdir()
    service = ServiceManager(directory, store_max)
    try:
        yield service
    finally:
        code = service.close()
        remove_tempdir(directory)
    assert code in (0, None), service.daemon.log() if service.daemon else ""
