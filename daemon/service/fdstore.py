"""systemd's file-descriptor store without libsystemd: sd_pid_notify_with_fds(3) and sd_listen_fds(3).

Storing: a datagram to ``$NOTIFY_SOCKET`` with ``FDSTORE=1``, ``FDNAME=<name>`` and ``FDPOLL=0`` (the
fds are memory, not connections: systemd must not drop them on a poll event) carrying the fds as
``SCM_RIGHTS``; ``FDSTOREREMOVE=1`` with ``FDNAME=`` closes the stored fds of that name. The unit
must set ``FileDescriptorStoreMax=`` (systemd then says how many in ``$FDSTORE``, which 0 turns off).

At the next start systemd passes the stored fds from fd 3 on, with ``LISTEN_PID`` (ours),
``LISTEN_FDS`` (how many) and ``LISTEN_FDNAMES`` (their names, colon-separated): read once by
:func:`listen_fds`, which unsets the three variables as sd_listen_fds(3) does with ``unset_environment``.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import threading
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

#: sd_listen_fds(3): the first passed fd.
LISTEN_FDS_START = 3


class ServiceFdStore:
    """The fd store of the service manager at ``address`` (``$NOTIFY_SOCKET``); any thread."""

    def __init__(self, address: str, limit: int | None) -> None:
        self.address = address
        #: ``$FDSTORE``: how many fds the store keeps; None where the service manager did not say (older systemd).
        self.limit = limit
        self._target = "\0" + address[1:] if address.startswith("@") else address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> ServiceFdStore | None:
        """The store when a service manager runs us with one (``$NOTIFY_SOCKET``, ``$FDSTORE`` not 0), else None."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET")
        if not address:
            return None
        limit: int | None = None
        if "FDSTORE" in env:
            try:
                limit = int(env["FDSTORE"])
            except ValueError:
                log.warning("ignoring FDSTORE=%r: not an integer", env["FDSTORE"])
            if limit == 0:
                return None
        return cls(address, limit)

    def store(self, name: str, fd: int) -> bool:
        return self._send(f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0", [fd])

    def remove(self, name: str) -> bool:
        return self._send(f"FDSTOREREMOVE=1\nFDNAME={name}", [])

    def _send(self, text: str, fds: list[int]) -> bool:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        with self._lock:
            try:
                self._socket.sendmsg([text.encode()], ancillary, 0, self._target)
            except OSError as exc:
                log.warning("fd store %s: %s failed: %s", self.address, text.replace("\n", " "), exc)
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._socket.close()


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[tuple[str, int]]:
    """The fds the service manager passed us, as (name, fd), close-on-exec from now on; [] without any.

    Only when ``LISTEN_PID`` is this process (the variables are inherited otherwise). The variables are
    removed either way, so that no child of ours takes the fds for its own.
    """
    env = os.environ if environ is None else environ
    pid, count, names = env.pop("LISTEN_PID", ""), env.pop("LISTEN_FDS", ""), env.pop("LISTEN_FDNAMES", "")
    if not count:
        return []
    if pid != str(os.getpid()):
        log.warning("LISTEN_FDS=%s is for pid %s, not this one (%d): ignored", count, pid, os.getpid())
        return []
    try:
        n = int(count)
    except ValueError:
        log.warning("ignoring LISTEN_FDS=%r: not an integer", count)
        return []
    labels = names.split(":") if names else []
    if len(labels) != n:
        log.warning("LISTEN_FDNAMES names %d fd(s), LISTEN_FDS says %d: the unnamed ones are 'unknown'",
                    len(labels), n)
        labels = (labels + ["unknown"] * n)[:n]
    passed = []
    for index, label in enumerate(labels):
        fd = LISTEN_FDS_START + index
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        except OSError as exc:
            log.warning("passed fd %d (%s) is not open: %s", fd, label, exc)
            continue
        passed.append((label, fd))
    return passed
