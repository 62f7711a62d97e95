"""Issue 40, item 1, on a GPU: four torch workers computing with a 2.25 GiB published bf16 model (18 matrices of
8192 x 8192, VMM memory) get the same output bits after the daemon's SIGTERM, ``cuctx shutdown`` and SIGKILL, run
plain and under the test service manager. The body is :mod:`tests.reliability.mapped_through_stop` (the sim runs
it in :mod:`tests.reliability.test_mapped_through_stop`); each case prints one ``STOP-CASE`` line (``-s``)."""

from __future__ import annotations

import pytest

from tests.reliability.mapped_through_stop import EXIT_STATUS, Model, run_case

pytestmark = pytest.mark.timeout(300)

MODEL = Model(18, 8192, 64)
WORKERS = 4


@pytest.mark.parametrize("managed", [False, True], ids=["plain", "service-manager"])
@pytest.mark.parametrize("stop", ["sigterm", "shutdown", "sigkill"])
def test_four_torch_workers_compute_the_same_bits_after_the_stop_on_the_gpu(stop: str, managed: bool) -> None:
    result = run_case("cuda", stop, managed=managed, model=MODEL, workers=WORKERS, ready_timeout=120, timeout=180)
    print(result.line())
    assert result.identical, f"{result.line()}\n{result.log[-4000:]}"
    assert result.exit_status == EXIT_STATUS[stop], result.log[-4000:]
