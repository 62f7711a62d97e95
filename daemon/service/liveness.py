"""Proof that the front thread serves requests: ``ping`` over an inproc endpoint of the ROUTER.

systemd is told ``READY=1`` only once the front has answered a ping (so every
worker is up, the ROUTER is bound and the loop runs), and ``WATCHDOG=1`` only
while it keeps answering: a front loop that hangs stops the pings and systemd
restarts the unit. The probe is a client like any other, through the same
socket and decoder, so "alive" means "a client would get an answer"; during a
drain the answer is ``CUCTXD_ERROR_SHUTTING_DOWN``, which still counts.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from cuctxd.daemon.service.notify import Notifier
from cuctxd.protos.errors import CuctxError
from cuctxd.protos.messages import encode_request, parse_reply

log = logging.getLogger(__name__)

#: The ROUTER's extra endpoint for the probe; inproc, so only this process can reach it.
PROBE_ENDPOINT = "inproc://cuctxd-liveness"
#: Seconds between checks for :meth:`FrontProbe.stop` while a ping waits.
_POLL_SLICE = 0.1


class FrontProbe:
    """A thread owning one DEALER socket in the daemon's ZeroMQ context.

    ``status`` is called on the probe thread for the STATUS= text; it must only
    read what is safe to read from another thread (sizes, counters).
    """

    def __init__(self, zmq_context: zmq.Context[Any], notifier: Notifier, status: Callable[[], str]) -> None:
        self._zmq_context = zmq_context
        self._notifier = notifier
        self._status = status
        self._stop = threading.Event()
        self.ready = threading.Event()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="cuctxd-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        socket = self._zmq_context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(PROBE_ENDPOINT)
            while not self._stop.is_set():
                if self._ping(socket, timeout=1.0):
                    break
            else:
                return
            log.debug("the front answered the first liveness ping")
            self._notifier.ready(self._status())
            self.ready.set()
            log.debug("READY=1 sent")
            interval = self._notifier.watchdog_interval
            if interval is None:
                return
            log.info("systemd watchdog: pinging every %.3g s while the front answers", interval)
            next_ping = time.monotonic()
            while not self._stop.wait(max(0.0, next_ping - time.monotonic())):
                next_ping = max(next_ping + interval, time.monotonic())
                if self._ping(socket, timeout=interval * 0.9):
                    self._notifier.watchdog()
                    self._notifier.status(self._status())
                else:
                    log.warning("the front did not answer a liveness ping within %.3g s; "
                                "no WATCHDOG=1 this time", interval)
        finally:
            socket.close()

    def _ping(self, socket: zmq.Socket[Any], timeout: float) -> bool:
        """True once the front answers this ping (with a result or an error); False on timeout or stop."""
        request_id = next(self._ids)
        socket.send(encode_request(request_id, "ping", None, {}))
        deadline = time.monotonic() + timeout
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not socket.poll(int(min(left, _POLL_SLICE) * 1000) + 1, zmq.POLLIN):
                continue
            header, *_ = socket.recv_multipart()
            try:
                reply = parse_reply(header)
            except CuctxError as exc:
                log.warning("liveness probe got a malformed reply: %s", exc)
                return False
            if reply.id == request_id:
                return True
            # a late answer to an earlier ping that timed out: wait on for ours
        return False
