"""Memory counted against nobody (issue 25, item 5): helper processes that each send ``hello`` to get
round ``max_sessions_per_peer`` meet ``max_sessions_per_uid``. The bystander (``conftest.py``) is served
throughout and nothing is left behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from cuctxd import Client
from cuctxd.protos.errors import LimitExceeded
from tests.adversarial.attacks import BYSTANDER_SIZE, Bystander, assert_alive
from tests.helpers import DaemonProcess, spawn_client, wait_for_line

MIB = 1 << 20
#: Sessions one uid may hold: the bystander's and three of the attacker's helpers.
PER_UID = 4

#: One helper process: one session holding 8 MiB, then it waits to be killed.
HELPER = """
import sys, time
from cuctxd import Client
from cuctxd.protos.errors import LimitExceeded
try:
    c = Client(ENDPOINT, name="helper", timeout=10)
except LimitExceeded as refused:
    print("refused", refused.name, str(refused).split(":")[2].split()[0], flush=True)
    sys.exit(0)
c.alloc(8 << 20, device=0)
print("holding", c.session_id, flush=True)
time.sleep(60)
"""


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    return ("--max-sessions-per-peer", "2", "--max-sessions-per-uid", str(PER_UID), "--session-quota", "8MiB",
            "--lease-ttl", "1")


@pytest.fixture
def helpers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_helper_processes_each_saying_hello_meet_the_per_uid_session_limit(
        attack_daemon: DaemonProcess, bystander: Bystander, helpers: ExitStack) -> None:
    holding = []
    for _ in range(PER_UID - 1):  # the bystander holds the uid's first session
        helper = helpers.enter_context(spawn_client(HELPER, attack_daemon.endpoint))
        helpers.callback(helper.kill)
        holding.append(wait_for_line(helper, "holding"))
    with spawn_client(HELPER, attack_daemon.endpoint) as refused:
        line = wait_for_line(refused, "refused")
        refused.wait(timeout=30)
    assert line.split()[1:] == ["CUCTXD_ERROR_LIMIT_EXCEEDED", "max_sessions_per_uid"], line
    with pytest.raises(LimitExceeded, match=r"^hello: .*max_sessions_per_uid"):
        Client(attack_daemon.endpoint, timeout=10)
    bystander.check()
    helpers.close()  # the helpers die; their leases run out and their sessions end
    deadline = time.monotonic() + 10
    while bystander.client.status()["session_count"] > 1:
        assert time.monotonic() < deadline, "the helpers' sessions outlived their leases"
        time.sleep(0.05)
    assert [s["bytes"] for s in bystander.client.status()["devices"][0]["sessions"]] == [BYSTANDER_SIZE]
    with Client(attack_daemon.endpoint, timeout=10) as after:  # the uid may open sessions again
        assert after.alloc(8 * MIB, device=0).size == 8 * MIB
    assert_alive(attack_daemon)
