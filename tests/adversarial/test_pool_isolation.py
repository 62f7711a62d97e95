"""Reading other sessions' memory through what sharing hands out (issue 25, item 4; issue 40, item 5), on the sim.

The attacker exports its own small buffer, opens it with ``pool_fd`` and maps the whole fd it receives (its VMM
allocation's memfd, or on a device without VMM its pool's, as
:class:`cuctxd.client.data_plane.ipc_sim.SimPoolImport` does), then scans it: it must find nothing of another
session's. Memory that was shared and is freed must not be readable afterwards, neither through a mapping the
holder kept nor by the next allocation. The bystander (``conftest.py``) is served throughout.
"""

from __future__ import annotations

import mmap
import os
import secrets

import pytest

from cuctxd import Client
from cuctxd.client.wire import build
from tests.adversarial.attacks import Bystander, assert_alive
from tests.helpers import DaemonProcess, run_client

#: The attacker: a 256 B shareable buffer of its own, exported and opened with ``pool_fd``; the fd it gets
#: is mapped whole and scanned for the victim's secret (and the bystander's bytes).
ATTACKER = """
import mmap, os
from cuctxd import Client
from cuctxd.client.wire import build
from tests.helpers import pattern

with Client(ENDPOINT, name="attacker") as c:
    own = c.alloc(256, device=0, shareable=True)
    descriptor = c.export(own)
    _, ticket = c.run(build.open_shared(descriptor, pool_fd=True))
    fds, _ = c._plane.channel.fetch(ticket)
    size = os.fstat(fds[0]).st_size
    with mmap.mmap(fds[0], size) as whole:
        os.close(fds[0])
        found = whole.find(bytes.fromhex(SECRET)) >= 0 or whole.find(pattern(4096, seed=99)) >= 0
        whole[:size] = b"\\xff" * size  # and write over everything the fd reaches
    print("mapped", size, "found" if found else "clean")
"""


@pytest.mark.parametrize("attack_daemon_args", [(), ("--no-sim-vmm",)], ids=["vmm", "pool of its own"])
def test_an_exported_buffers_fd_reaches_no_other_sessions_memory(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    secret = secrets.token_bytes(32)
    with Client(attack_daemon.endpoint, name="victim") as victim:
        private = victim.alloc(4096, device=0)
        private.write(secret * 128)
        kept = victim.alloc(4096, device=0, shareable=True)  # shareable, never shared
        kept.write(secret * 128)
        before = victim.alloc(256, device=0, shareable=True)
        before.write(secret * 8)
        victim.export(before)  # another session's export: its own allocation (or pool) too
        out = run_client(f"SECRET = {secret.hex()!r}\n{ATTACKER}", attack_daemon.endpoint).split()
        assert out[0] == "mapped" and out[2] == "clean", out
        assert int(out[1]) <= 2 << 20, "the fd reaches more than the attacker's own buffer"
        for buffer, size in ((private, 4096), (kept, 4096), (before, 256)):
            assert buffer.read() == (secret * 128)[:size], "the attacker wrote over the victim's memory"
        bystander.check()
    assert_alive(attack_daemon)
    with Client(attack_daemon.endpoint) as observer:
        assert all(not device["shares"] for device in observer.status()["devices"])


#: The victim: a shareable buffer smaller than a page (so no page of it is punched out of the memfd when
#: it is freed: only the scrub can clear it), published under a name; then the session ends.
VICTIM = """
from cuctxd import Client

with Client(ENDPOINT, name="victim") as c:
    buffer = c.alloc(1000, device=0, shareable=True)
    buffer.write(bytes.fromhex(SECRET) * 31)
    c.publish(buffer, "victim-weights")
print("published")
"""


def test_freed_shared_memory_is_zeroed_for_a_holder_that_kept_its_mapping_and_for_the_next_user(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    secret = secrets.token_bytes(32)
    run_client(f"SECRET = {secret.hex()!r}\n{VICTIM}", attack_daemon.endpoint)
    with Client(attack_daemon.endpoint, name="attacker") as attacker:
        descriptor, ticket = attacker.run(build.open_shared(attacker.lookup("victim-weights"), pool_fd=True))
        assert ticket is not None
        fds, _ = attacker._plane.channel.fetch(ticket)  # type: ignore[union-attr]
        with mmap.mmap(fds[0], os.fstat(fds[0]).st_size) as kept:
            os.close(fds[0])
            assert kept.find(secret) >= 0  # it was shared with everyone: readable while held
            attacker.unpublish("victim-weights")  # the victim's uid, which may once the victim is gone
            attacker.status()  # reaches the device after the unpublish's own task there, which drops the name
            attacker.run(build.close_shared(descriptor))  # the last hold: the memory is freed
            assert kept.find(secret) < 0, "the freed share's bytes are still readable through a kept mapping"
        fresh = [attacker.alloc(1000, device=0, shareable=True), attacker.alloc(1000, device=0),
                 attacker.alloc(2 << 20, device=0, shareable=True)]
        assert all(secret not in buffer.read() for buffer in fresh), "the next user got the shared bytes"
        bystander.check()
        for buffer in fresh:
            buffer.free()
        assert all(not device["shares"] for device in attacker.status()["devices"])
    assert_alive(attack_daemon)
