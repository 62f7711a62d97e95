"""Issue 40, item 1, on the sim: every stop of the daemon leaves the bytes of a share to the processes that map it
(:mod:`tests.reliability.mapped_through_stop` has the body; :mod:`tests.gpu.test_mapped_through_stop_gpu` runs it
with torch workers and a 2.25 GiB model on a GPU).

Beside it: a share kept by its holders alone (unnamed, its owner gone) through a drain longer than the lease, which
would reap the holders' sessions (their heartbeats are refused while draining); a device that turned unusable
(a sticky error) before the stop, so every step of the stop fails; and, during operation, the scrub that protects
the next tenant stays (the share freed once no session keeps it reads as zeros through a mapping kept after it).
"""

from __future__ import annotations

import pytest

from tests.reliability.mapped_through_stop import STOPS, EXIT_STATUS, Model, run_case

pytestmark = pytest.mark.timeout(120)

#: Three matrices of 64 x 64 (24 KiB: a pool of its own); 40 MiB (above POOL_BUFFER_MAX: VMM memory).
SMALL, LARGE = Model(3, 64, 4), Model(5, 2048, 4)
WORKERS = 2


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
