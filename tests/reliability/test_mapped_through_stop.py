"""Issue 40, item 1, on the sim: every stop of the daemon leaves the bytes of a share to the processes that map it
(:mod:`tests.reliability.mapped_through_stop` has the body; :mod:`tests.gpu.test_mapped_through_stop_gpu` runs it
with torch workers and a 2.25 GiB model on a GPU).

Beside it: a share kept by its holders alone (unnamed, its owner gone) through a drain longer than the lease, which
would reap the holders' sessions (their heartbeats are refused while draining); a device that turned unusable
(a sticky error) before the stop, so every step of the stop fails; and, during operation, the scrub that protects
the next tenant stays (the share freed once no session keeps it reads as zeros through a mapping kept after it).
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import signal
from collections.abc import Iterator

import pytest

from cuctxd import Client
from cuctxd.client import CudaError
from tests.helpers import DaemonProcess, pattern, remove_tempdir, short_tempdir, start_daemon
from tests.reliability.mapped_through_stop import (
    DRAIN_ARGS,
    EXIT_STATUS,
    STOPS,
    Model,
    Script,
    held_replies,
    run_case,
)

pytestmark = pytest.mark.timeout(120)

#: Three matrices of 64 x 64 (24 KiB: a pool of its own); 40 MiB (above POOL_BUFFER_MAX: VMM memory).
SMALL, LARGE = Model(3, 64, 4), Model(5, 2048, 4)
WORKERS = 2
#: Driver calls in a live context of the device before it turns sticky: past the setup of the sticky test.
STICKY_AFTER = 100


@pytest.mark.parametrize("managed", [False, True], ids=["plain", "service-manager"])
@pytest.mark.parametrize("stop", STOPS)
def test_workers_compute_the_same_bits_after_the_stop(stop: str, managed: bool) -> None:
    result = run_case("sim", stop, managed=managed, model=SMALL, workers=WORKERS)
    print(result.line())
    assert result.identical, f"{result.line()}\n{result.log[-4000:]}"
    assert result.exit_status == EXIT_STATUS[stop], result.log[-4000:]
    if stop != "sigkill":
        assert "1 shared buffer(s), " in result.log and "(1 held open by a session" in result.log, \
            result.log[-4000:]
    if stop == "drain_timeout":
        assert "drain timed out" in result.log and "reaped" not in result.log, result.log[-4000:]


def test_workers_compute_the_same_bits_after_sigterm_with_vmm_memory() -> None:
    result = run_case("sim", "sigterm", managed=False, model=LARGE, workers=WORKERS)
    print(result.line())
    assert result.identical, f"{result.line()}\n{result.log[-4000:]}"
    assert result.exit_status == 0, result.log[-4000:]


#: Holds a share by the descriptor it reads on its stdin (never published: kept by its holders alone once its
#: owner is gone) and prints the SHA-256 of its bytes before and after the stop.
HOLDER = """
import hashlib, os, pickle, sys
from cuctxd import Client
c = Client(ENDPOINT, name="holder")
opened = c.open_shared(pickle.loads(bytes.fromhex(sys.stdin.readline())))
view = opened.host_view()
print("before", hashlib.sha256(view).hexdigest(), flush=True)
sys.stdin.readline()
print("after", hashlib.sha256(view).hexdigest(), flush=True)
os._exit(0)
"""


@contextlib.contextmanager
def holding(*daemon_args: str) -> Iterator[tuple[DaemonProcess, Script]]:
    """A daemon (``daemon_args``) and a :data:`HOLDER` process for the block; both stopped after it."""
    workdir = short_tempdir()
    daemon = start_daemon("--sim-devices", "1", *daemon_args)
    holder = Script(workdir, "holder", HOLDER, daemon.endpoint)
    try:
        yield daemon, holder
    finally:
        holder.close()
        daemon.stop()
        remove_tempdir(daemon.socket_dir)
        remove_tempdir(workdir)


def hand_over(owner: Client, holder: Script, seed: int) -> str:
    """A shareable buffer of ``owner``'s, filled, exported and opened by ``holder``: the digest it read."""
    buffer = owner.alloc(64 << 10, shareable=True)
    buffer.write(pattern(64 << 10, seed=seed))
    holder.tell(pickle.dumps(owner.export(buffer)).hex())
    before = holder.line("before", 30).split()[1]
    assert before == hashlib.sha256(pattern(64 << 10, seed=seed)).hexdigest()
    return before


def test_a_share_kept_by_its_holder_alone_outlives_a_drain_longer_than_the_lease() -> None:
    with holding(*DRAIN_ARGS) as (daemon, holder):
        with Client(daemon.endpoint, name="owner") as owner:
            before = hand_over(owner, holder, seed=40)
        with Client(daemon.endpoint) as observer:  # the owner is gone: its holder alone keeps it
            assert [len(share["holders"]) for device in observer.status()["devices"] for share in device["shares"]] \
                == [1], observer.status()["devices"]
        with held_replies(daemon.endpoint):
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(30) == 1, daemon.log()[-4000:]
        holder.tell()
        assert holder.line("after", 30).split()[1] == before, daemon.log()[-4000:]
        assert "reaped" not in daemon.log() and "(1 held open by a session" in daemon.log(), daemon.log()[-4000:]


def test_a_stop_on_a_device_that_turned_unusable_leaves_the_share_to_its_holder() -> None:
    """An error at exit, from a real condition: the device turns sticky (the sim's fault injection, as a corrupted
    CUDA context does) once the share is held, so every driver call of the stop fails there."""
    with holding("--sim-fault", f"0:{STICKY_AFTER}:CUDA_ERROR_ILLEGAL_ADDRESS") as (daemon, holder):
        with Client(daemon.endpoint, name="owner") as owner:
            before = hand_over(owner, holder, seed=41)
            private = owner.alloc(4096)
            with pytest.raises(CudaError) as struck:
                for _ in range(10 * STICKY_AFTER):
                    private.fill(1)
            assert struck.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(30) == 0, daemon.log()[-4000:]
        holder.tell()
        assert holder.line("after", 30).split()[1] == before, daemon.log()[-4000:]
        log = daemon.log()
        assert "at shutdown: CUDA_ERROR_ILLEGAL_ADDRESS" in log and "(1 held open by a session" in log, log[-4000:]
