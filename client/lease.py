"""The background heartbeat that keeps a session's lease alive without the user's help."""

from __future__ import annotations

import logging
import threading

from client.transport import Transport
from protos.errors import CuctxError, SessionExpired, UnknownSession

log = logging.getLogger(__name__)


class Heartbeat:
    """A daemon thread with its own socket, so a long call on the main socket never starves it."""

    def __init__(self, endpoint: str, token: str, lease_ttl: float) -> None:
        self._transport = Transport(endpoint, timeout=max(1.0, lease_ttl))
        self._token = token
        self._interval = max(0.05, lease_ttl / 3)
        self._stop = threading.Event()
        self.expired = False
        self._thread = threading.Thread(target=self._run, name="cuctxd-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._transport.call("heartbeat", {}, self._token)
            except (SessionExpired, UnknownSession):
                self.expired = True
                return
            except CuctxError as exc:  # a slow or restarting daemon: keep trying
                log.debug("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._transport.close()
