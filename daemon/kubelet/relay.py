"""A byte relay from a socket the daemon may open to the kubelet's PodResources socket, which it may not.

The kubelet makes its PodResources socket root's (mode 0755: connecting needs write permission), and
the daemon runs as its own user. The device plugin's container runs as root anyway (the kubelet's
plugin directory is root's), so it relays: it listens on ``listen`` in a directory only the two
containers share (an emptyDir), and copies bytes both ways between each connection and a new one to
``upstream``. It reads nothing of them: gRPC passes through unchanged, and only the PodResources API
(read-only, every pod's devices) is reachable through it. Threads: one accepts, two per connection copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

#: Connections relayed at once; more wait in the listen queue (the daemon makes one per pod's first session).
MAX_RELAYED = 16
_CHUNK = 1 << 16


class Relay:
    """Relays connections on ``listen`` to ``upstream`` until :meth:`stop`."""

    def __init__(self, listen: str, upstream: str) -> None:
        self.listen = listen
        self.upstream = upstream
        self._slots = threading.BoundedSemaphore(MAX_RELAYED)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(listen)
        os.chmod(listen, 0o666)  # the daemon's user; the directory keeps everyone else out
        self._listener.listen(MAX_RELAYED)
        self.thread = threading.Thread(target=self._accept, name="cuctxd-relay", daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("relaying %s to %s", self.listen, self.upstream)

    def stop(self) -> None:
        """Stop accepting (any thread); relayed connections end with their peers."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen)

    def _accept(self) -> None:
        while True:
            self._slots.acquire()
            try:
                client, _ = self._listener.accept()
            except OSError:  # stopped
                self._slots.release()
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.upstream)
            except OSError as error:
                log.warning("cannot reach %s for a relayed connection: %s", self.upstream, error)
                client.close()
                upstream.close()
                self._slots.release()
                continue
            done = threading.Barrier(2, action=self._slots.release)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_copy, args=(source, sink, done), name="cuctxd-relay-copy",
                                 daemon=True).start()


def _copy(source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
    """Bytes from ``source`` to ``sink`` until ``source`` ends; then ``sink`` learns it, and once both
    directions ended, both sockets close."""
    how = socket.SHUT_WR
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
    except OSError:
        how = socket.SHUT_RDWR  # a failed side: end the other direction too
    with contextlib.suppress(OSError):
        sink.shutdown(how)
    done.wait()
    source.close()
