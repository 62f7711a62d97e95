"""One uid cannot fill the service manager's fd store for the others (issue 40, item 4). Before, one session filled
the store with tiny persistent names and a victim's later persistent publish answered ok and was gone at the next
restart. Now each uid parks at most its share of the store (``max_parked_fds_per_uid``), the filler's next one
fails by name, and the victim's is parked and survives. The filler runs as a uid of its own
(:mod:`tests.adversarial.other_uid`), so this needs root."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cuctxd import Client
from cuctxd.client.wire import build as requests
from tests.adversarial.other_uid import FORGER_UID, GROUP, needs_root, run_as
from tests.service_manager import ServiceManager, managed

FILLER = """
import sys
from cuctxd import Client, NotParked
from cuctxd.client.wire import build
with Client(sys.argv[1], name="filler") as c:
    parked = 0
    try:
        while parked < 1000:
            buffer = c.alloc(4096, shareable=True)
            c.run(build.publish(buffer, f"filler-{parked}", None, True, False))
            parked += 1
    except NotParked as exc:
        print("parked", parked, exc.message.split(":")[0], flush=True)
"""


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    with managed(store_max=64) as service:
        service.workdir.chmod(0o755)  # the group's members pass through to the daemon's socket directory
        yield service


@needs_root
def test_a_uid_filling_the_store_is_stopped_at_its_share_and_the_victim_still_parks(manager: ServiceManager) -> None:
    daemon = manager.start("--sim-devices", "1", "--group", str(GROUP),
                           endpoint=f"ipc://{manager.workdir}/run/d.sock")
    filled = run_as(FORGER_UID, "-c", FILLER, daemon.endpoint)
    assert filled.returncode == 0, filled.stderr
    assert filled.stdout.split() == ["parked", "8", "max_parked_fds_per_uid"]  # 16 of the 64 fds, 2 a share
    with Client(daemon.endpoint, name="victim") as c:
        buffer = c.alloc(4096, shareable=True)
        victim = c.run(requests.publish(buffer, "victim", None, True, False))
        parking = c.status()["parking"]
    assert parking["uids"] == [{"uid": FORGER_UID, "fds": 16}, {"uid": os.getuid(), "fds": 2}]
    daemon = manager.restart("--sim-devices", "1", "--group", str(GROUP))
    with Client(daemon.endpoint) as c:
        listed = {s["name"]: s["share_id"] for s in c.list_shared()}
    assert listed["victim"] == victim.share_id and len(listed) == 9
