"""The four faults of issue "Nothing lost", on the sim (:mod:`tests.reliability.nothing_lost` has the bodies;
:mod:`tests.gpu.test_nothing_lost_gpu` runs them on a GPU)."""

from __future__ import annotations

import pytest

from tests.helpers import DaemonProcess, remove_tempdir, start_daemon
from tests.reliability.nothing_lost import (
    AT_ONCE_S,
    drain_answers_a_slow_reader,
    idle_session_learns_of_a_restart_at_once,
    pipeline_gives_up_once_the_daemon_is_gone,
    staging_ring_outlives_a_created_context,
)

SIM = ("--sim-devices", "2", "--sim-memory", "256MiB")

pytestmark = pytest.mark.timeout(90)


def test_the_staging_ring_outlives_a_created_context(daemon: DaemonProcess) -> None:
    staging_ring_outlives_a_created_context(daemon.endpoint)
    staging_ring_outlives_a_created_context(daemon.endpoint, size=20 << 20)  # several slots, edge chunks


def test_an_idle_session_learns_of_a_restart_on_its_first_call() -> None:
    first = start_daemon(*SIM)
    second = idle_session_learns_of_a_restart_at_once(first, lambda endpoint: start_daemon(*SIM, endpoint=endpoint),
                                                      devices=2)
    try:
        assert second.stop() == 0, second.log()
    finally:
        remove_tempdir(second.socket_dir)


def test_a_pipeline_gives_up_at_once_whatever_its_first_error() -> None:
    process = start_daemon(*SIM)
    try:
        took = pipeline_gives_up_once_the_daemon_is_gone(process)
    finally:
        remove_tempdir(process.socket_dir)
    assert took < 1 + AT_ONCE_S, f"the pipeline took {took:.2f} s to give up"


def test_a_drain_answers_a_slow_readers_replies_before_it_exits_0() -> None:
    process = start_daemon(*SIM)
    try:
        received, code = drain_answers_a_slow_reader(process)
        process.close_pipes()
    finally:
        remove_tempdir(process.socket_dir)
    assert received == 12
    assert code == 0, process.log()
