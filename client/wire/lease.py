"""The background heartbeat that keeps a session's lease alive without the user's help.

:class:`Heartbeat` is a thread for the sync client, :class:`AsyncHeartbeat` a
task for the async one. Each has its own socket, so a long call or a full
window on the client's socket never delays a beat; both beat three times per
lease and stop for good once the daemon says the session is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from cuctxd.client.wire import build
from cuctxd.client.wire.async_socket_transport import AsyncTransport
from cuctxd.client.wire.socket_transport import CurveKeys, Transport
from cuctxd.client.wire.transport import DaemonWatch
from cuctxd.protos.errors import CuctxError, SessionExpired, UnknownSession

log = logging.getLogger(__name__)

#: A beat (sent on the heartbeat's own transport, not run by the client: only its op and args are used).
_BEAT = build.heartbeat()


class _Beats:
    """What both heartbeats share: the session, the pace, and what a failed beat means."""

    def __init__(self, token: str, lease_ttl: float) -> None:
        self._token = token
        self._interval = max(0.05, lease_ttl / 3)
        self._timeout = max(1.0, lease_ttl)
        self.expired = False

    def _gone(self, exc: CuctxError) -> bool:
        """Note a failed beat; True when the session is gone (stop beating)."""
        if isinstance(exc, (SessionExpired, UnknownSession)):
            self.expired = True
            return True
        log.debug("heartbeat failed: %s", exc)  # a slow or restarting daemon: keep trying
        return False


class Heartbeat(_Beats):
    """A daemon thread with its own socket, so a long call on the main socket never starves it."""

    def __init__(self, endpoint: str, token: str, lease_ttl: float, curve: CurveKeys | None = None,
                 watch: DaemonWatch | None = None) -> None:
        """``watch``: the session's, so that a beat sent to a daemon that died fails as soon as the session's
        calls do."""
        super().__init__(token, lease_ttl)
        self._transport = Transport(endpoint, timeout=self._timeout, curve=curve, watch=watch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cuctxd-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._transport.call(_BEAT.op, _BEAT.args, self._token)
            except CuctxError as exc:
                if self._gone(exc):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._transport.close()


class AsyncHeartbeat(_Beats):
    """A task of the running loop with its own socket; it beats only while the loop runs,
    so code that blocks the loop for a whole lease loses the session."""

    def __init__(self, endpoint: str, token: str, lease_ttl: float, curve: CurveKeys | None = None,
                 watch: DaemonWatch | None = None) -> None:
        """``watch``: as for :class:`Heartbeat`."""
        super().__init__(token, lease_ttl)
        self._transport = AsyncTransport(endpoint, timeout=self._timeout, curve=curve, watch=watch)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cuctxd-heartbeat")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._transport.call(_BEAT.op, _BEAT.args, self._token)
            except CuctxError as exc:
                if self._gone(exc):
                    return

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])
        await self._transport.close()
