"""The drain deadline is final: after ``--drain-timeout`` no reply goes out and the daemon exits soon.

A daemon told to stop drains: it answers the work in flight for at most
``drain_timeout`` seconds. Work queued beyond that is dropped unanswered (the
client sees the connection go), sessions are closed, and the process exits
within ``drain_timeout`` + ``max(1, min(5, drain_timeout))`` seconds of the signal,
with exit status 1 (``daemon/service/server.py``); a client counting replies sees none after the
deadline, on the main endpoint or on a device's own.
"""

from __future__ import annotations

import signal
import time

from tests.adversarial.attacks import flood, scaled
from tests.helpers import remove_tempdir, start_daemon, wait_for_log
from tests.helpers_raw import RawPeer

DRAIN_TIMEOUT = 1.0
#: Seconds the daemon may take to close sessions after the deadline (server.STOP_GRACE, at most the timeout).
CLOSE_GRACE = max(1.0, min(5.0, DRAIN_TIMEOUT))
#: Slack for the signal's delivery and the process's own start of the drain and its teardown.
SLACK = 1.0
#: Replies still on their way at the deadline: the reply of the op running when it passed, read late. The
#: times are taken here, when this process reads the replies: on a loaded 2-core machine it can be
#: scheduled 0.3 s late and find a burst sent before the deadline (seen in CI).
IN_TRANSIT = 0.5
FILL_SIZE = 128 << 20
#: Fills queued per session: several seconds of work in all, far past the drain timeout.
FILLS = scaled(300)
SESSIONS = 4


def test_no_reply_goes_out_after_the_drain_deadline_and_the_exit_is_bounded() -> None:
    daemon = start_daemon("--sim-devices", "1", "--sim-memory", "1GiB", "--drain-timeout", str(DRAIN_TIMEOUT))
    peers: list[RawPeer] = []
    try:
        first = RawPeer(daemon.endpoint)
        peers.append(first)
        hello, _ = first.ok("hello", {"protocol": 1, "client": "drain-test", "pid": 1})
        lane = hello["device_endpoints"][0][0]
        floods = []
        for index in range(SESSIONS):  # half through the front, half on the device's own endpoint
            session = str(hello["session"]) if index == 0 else first.hello()
            peer = RawPeer(lane if index % 2 else daemon.endpoint)
            peers.append(peer)
            buffer, _ = peer.ok("alloc", {"size": FILL_SIZE, "device": 0}, session)
            floods.append((peer, {"buffer": buffer["buffer"]["handle"], "value": 7, "device": 0}, session))
        for peer, args, session in floods:
            assert len(flood(peer, "fill", args, session, FILLS)) == FILLS
        assert peers[1].has_reply(10.0), "no fill was answered before the signal"

        signalled = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        replies_at: list[float] = []
        while daemon.process.poll() is None or any(p.has_reply(0) for p in peers):
            if time.monotonic() - signalled > DRAIN_TIMEOUT + CLOSE_GRACE + 10:
                break
            for peer in peers:
                while peer.has_reply(0):
                    peer.socket.recv_multipart()
                    replies_at.append(time.monotonic() - signalled)
            time.sleep(0.002)
        exited_after = time.monotonic() - signalled
        code = daemon.process.wait(10)
        for peer in peers:  # a reply still queued in a socket would have been counted above
            while peer.has_reply(0.2):
                peer.socket.recv_multipart()
                replies_at.append(time.monotonic() - signalled)

        wait_for_log(daemon, "drain timed out")
        late = [round(t, 3) for t in replies_at if t > DRAIN_TIMEOUT + IN_TRANSIT]
        assert late == [], f"{len(late)} replies after the drain deadline: {late[:20]}"
        assert exited_after <= DRAIN_TIMEOUT + CLOSE_GRACE + SLACK, (
            f"exited {exited_after:.2f} s after SIGTERM, over {DRAIN_TIMEOUT} + {CLOSE_GRACE} + {SLACK} s")
        assert code == 1, daemon.log()[-3000:]  # work was dropped unanswered
        assert any(0 < t <= DRAIN_TIMEOUT for t in replies_at), "the drain answered nothing before its deadline"
    finally:
        for peer in peers:
            peer.close()
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.process.wait()
        daemon.close_pipes()
        remove_tempdir(daemon.socket_dir)
