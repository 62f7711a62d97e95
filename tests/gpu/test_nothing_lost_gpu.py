"""The four faults of issue "Nothing lost" on a GPU, where the staging ring and the shm lanes are real pinned
and shared memory (the bodies are :mod:`tests.reliability.nothing_lost`'s; the sim runs them in
:mod:`tests.reliability.test_nothing_lost`)."""

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

pytestmark = pytest.mark.timeout(300)


def _cuda_daemon(endpoint: str | None = None) -> DaemonProcess:
    return start_daemon(backend="cuda", ready_timeout=120, endpoint=endpoint)


def test_the_staging_ring_outlives_a_created_context_on_the_gpu(cuda_daemon: DaemonProcess) -> None:
    staging_ring_outlives_a_created_context(cuda_daemon.endpoint)
    staging_ring_outlives_a_created_context(cuda_daemon.endpoint, size=40 << 20)


def test_an_idle_session_learns_of_a_restart_at_once_on_the_gpu() -> None:
    first = _cuda_daemon()
    second = idle_session_learns_of_a_restart_at_once(first, _cuda_daemon, devices=1)
    try:
        assert second.stop(timeout=60) == 0, second.log()
    finally:
        remove_tempdir(second.socket_dir)


def test_a_pipeline_gives_up_at_once_on_the_gpu() -> None:
    process = _cuda_daemon()
    try:
        took = pipeline_gives_up_once_the_daemon_is_gone(process)
    finally:
        remove_tempdir(process.socket_dir)
    assert took < 1 + AT_ONCE_S, f"the pipeline took {took:.2f} s to give up"


def test_a_drain_answers_a_slow_reader_on_the_gpu() -> None:
    process = _cuda_daemon()
    try:
        received, code = drain_answers_a_slow_reader(process)
        process.close_pipes()
    finally:
        remove_tempdir(process.socket_dir)
    assert received == 12
    assert code == 0, process.log()
