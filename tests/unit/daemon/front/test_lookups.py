"""The lookup pool on its own: one lookup per key however many requests wait on it, its bound refused by name,
a lookup's error as the answer, and a doorbell that rings when a lookup is done and is gone after ``stop``."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator

import pytest

from cuctxd.daemon.front.lookups import Looked, LookupLimits, LookupPool, Waiting
from cuctxd.daemon.handlers.replies import Deferred, Reply
from cuctxd.protos.errors import DeviceNotAllowed, InternalError, LimitExceeded


@pytest.fixture
def pool() -> Iterator[LookupPool]:
    made = LookupPool(LookupLimits(max_pod_lookups=2, max_pending_hellos=3))
    try:
        yield made
    finally:
        if made.doorbell >= 0:
            made.stop()


def waiting(request_id: int) -> Waiting:
    return Waiting(b"client", request_id, "hello", lambda result: Reply({"result": result}), 0.0)


def finished(pool: LookupPool, count: int) -> list[Looked]:
    """The next ``count`` finished lookups, as the front takes them when the doorbell rings."""
    looked: list[Looked] = []
    while len(looked) < count:
        readable, _, _ = select.select([pool.doorbell], [], [], 30)
        assert readable, "the doorbell did not ring"
        looked += pool.finished()
    return looked


def test_requests_with_one_key_wait_on_one_lookup(pool: LookupPool) -> None:
    go = threading.Event()
    calls: list[str] = []

    def look_up() -> frozenset[int]:
        calls.append("pod-a")
        go.wait(30)
        return frozenset({1})

    for request_id in (1, 2):
        pool.submit(Deferred("pod-a", look_up, lambda result: Reply()), waiting(request_id))
    assert pool.to_status() == {"waiting": 2, "lookups": 1, "max_pod_lookups": 2, "max_pending_hellos": 3}
    go.set()
    [looked] = finished(pool, 1)
    assert [w.request_id for w in looked.waiting] == [1, 2] and looked.result == frozenset({1})
    assert looked.error is None and calls == ["pod-a"]
    assert pool.to_status()["waiting"] == 0


def test_past_max_pending_hellos_a_request_is_refused_by_name(pool: LookupPool) -> None:
    go = threading.Event()
    for request_id, key in enumerate(("pod-a", "pod-b", "pod-a")):
        pool.submit(Deferred(key, lambda: go.wait(30), lambda result: Reply()), waiting(request_id))
    with pytest.raises(LimitExceeded, match="max_pending_hellos: 3 request"):
        pool.submit(Deferred("pod-c", lambda: None, lambda result: Reply()), waiting(9))
    go.set()
    assert sorted(len(looked.waiting) for looked in finished(pool, 2)) == [1, 2]


def test_a_lookups_error_is_the_answer(pool: LookupPool) -> None:
    def refused() -> None:
        raise DeviceNotAllowed("gpu_limit: no pod of this node has UID x")

    def broken() -> None:
        raise ValueError("a bug")

    pool.submit(Deferred("refused", refused, lambda result: Reply()), waiting(1))
    pool.submit(Deferred("broken", broken, lambda result: Reply()), waiting(2))
    errors = {looked.waiting[0].request_id: looked.error for looked in finished(pool, 2)}
    assert isinstance(errors[1], DeviceNotAllowed) and "no pod" in errors[1].message
    assert isinstance(errors[2], InternalError), "a bug in a lookup is an internal error, logged"


def test_a_lookup_that_ends_after_stop_rings_nothing(pool: LookupPool) -> None:
    go, done = threading.Event(), threading.Event()

    def late() -> None:
        go.wait(30)
        done.set()

    pool.submit(Deferred("late", late, lambda result: Reply()), waiting(1))
    pool.stop()
    assert pool.doorbell == -1
    go.set()
    assert done.wait(30)
    for thread in pool._threads:
        thread.join(30)
        assert not thread.is_alive(), "each thread ends once its lookup is done"
