"""Warnings about failed requests: the first few of each kind per window one by one, then one line with a count."""

from __future__ import annotations

import logging

import pytest

from cuctxd.daemon.intake.observe import RepeatLimiter, RequestObserver


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_limiter_lets_a_burst_through_per_window_and_reports_what_it_held() -> None:
    clock = Clock()
    limiter = RepeatLimiter(burst=3, window=10.0, clock=clock)
    kind, other = ("free", "CUCTXD_ERROR_UNKNOWN_HANDLE"), ("publish", "CUCTXD_ERROR_BAD_ARGUMENT")
    assert [limiter.allow(kind) for _ in range(5)] == [(True, 0)] * 3 + [(False, 0)] * 2
    assert limiter.allow(other) == (True, 0)  # each kind has its own window
    clock.now += 9.9
    assert limiter.allow(kind) == (False, 0)
    clock.now += 0.1
    assert limiter.allow(kind) == (True, 3)  # a new window; the last one held back 3
    clock.now += 10.0
    assert sorted(limiter.ended()) == [(kind, 0), (other, 0)]
    assert limiter.ended() == []


def test_the_observer_logs_a_flood_as_a_burst_and_one_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    observer = RequestObserver(warnings=RepeatLimiter(burst=2, window=10.0, clock=clock))
    with caplog.at_level(logging.WARNING, logger="cuctxd.daemon.requests"):
        for request_id in range(1000):
            observer.finished("free", "CUCTXD_ERROR_UNKNOWN_HANDLE", 0.0, request_id)
        observer.report_held_back()  # the window has not ended: nothing yet
        clock.now += 10.0
        observer.report_held_back()
        observer.report_held_back()
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["request 0 (free) failed: CUCTXD_ERROR_UNKNOWN_HANDLE",
                     "request 1 (free) failed: CUCTXD_ERROR_UNKNOWN_HANDLE",
                     "998 more requests (free) failed with CUCTXD_ERROR_UNKNOWN_HANDLE within 10 s: not logged one "
                     "by one"]
