"""Multi-threaded host copies (the staging ring's copies): exact bytes at every size, one copy per gang at
a time, a failed piece reported to its caller and the gang still usable after."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import warnings

import pytest

from cuctxd.client.data_plane import host_copy
from cuctxd.protos.host import buffer_address

MiB = 1 << 20


@pytest.fixture
def four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gang of four whatever this host's CPUs, and small pieces so that small copies use it (monkeypatch
    puts them back)."""
    monkeypatch.setattr(host_copy, "COPY_THREADS", 4)
    monkeypatch.setattr(host_copy, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(host_copy, "_gang", None)


@pytest.mark.parametrize("size", [0, 1, 64 << 10, (128 << 10) - 1, 128 << 10, (256 << 10) + 3, 3 * MiB + 17])
def test_every_size_is_copied_exactly(four_threads: None, size: int) -> None:
    source = os.urandom(size)
    target = bytearray(size)
    host_copy.copy(memoryview(target), memoryview(source))
    assert target == source


def test_unequal_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="copy of 4 bytes into 3"):
        host_copy.copy(memoryview(bytearray(3)), memoryview(b"abcd"))


def test_a_copy_while_the_gang_is_busy_runs_on_its_caller(four_threads: None) -> None:
    source = os.urandom(MiB)
    target = bytearray(MiB)
    gang = host_copy._the_gang()
    with buffer_address(target) as to, buffer_address(source) as start:
        assert gang._busy.acquire(blocking=False)  # as if another thread's copy held it
        try:
            assert not gang.run([(to, start, MiB)])
            assert target == bytes(MiB)  # refused: nothing copied
            host_copy.copy(memoryview(target), memoryview(source))
        finally:
            gang._busy.release()
    assert target == source


def test_threads_copying_at_once_each_get_their_bytes(four_threads: None) -> None:
    sources = [os.urandom(2 * MiB + index) for index in range(6)]
    targets = [bytearray(len(source)) for source in sources]

    def copy(index: int) -> None:
        for _ in range(20):
            host_copy.copy(memoryview(targets[index]), memoryview(sources[index]))

    threads = [threading.Thread(target=copy, args=(index,)) for index in range(len(sources))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert targets == sources


def test_a_failed_piece_reaches_the_caller_and_the_gang_goes_on(four_threads: None) -> None:
    gang = host_copy.Gang(3)
    source = os.urandom(3 * 4096)
    target = bytearray(len(source))
    with buffer_address(target) as to, buffer_address(source) as start:
        with pytest.raises(ctypes.ArgumentError):
            gang.run([(to, start, 4096), (to + 4096, start + 4096, None), (to + 8192, start + 8192, 4096)])
        assert target[:4096] == source[:4096] and target[8192:] == source[8192:]  # the others finished
        assert gang.run([(to + at, start + at, 4096) for at in (0, 4096, 8192)])
    assert target == source


def test_a_failed_first_piece_still_waits_for_the_others(four_threads: None) -> None:
    gang = host_copy.Gang(2)
    source = os.urandom(2 * MiB)
    target = bytearray(len(source))
    with buffer_address(target) as to, buffer_address(source) as start:
        with pytest.raises(ctypes.ArgumentError):
            gang.run([(to, start, None), (to + MiB, start + MiB, MiB)])
        assert target[MiB:] == source[MiB:]  # the gang thread's piece was done before run returned
        assert gang.run([(to, start, MiB), (to + MiB, start + MiB, MiB)])
    assert target == source


def test_a_forked_child_copies_without_the_parents_gang(four_threads: None) -> None:
    """The gang's threads stay in the parent: a child waiting on them would hang, so it makes its own."""
    source = os.urandom(4 * MiB)
    host_copy.copy(memoryview(bytearray(len(source))), memoryview(source))  # the parent's gang exists
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: forking with threads (the point here)
        child = os.fork()
    if child == 0:
        target = bytearray(len(source))
        host_copy.copy(memoryview(target), memoryview(source))
        os._exit(0 if target == source else 1)
    deadline = time.monotonic() + 30
    while (waited := os.waitpid(child, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if waited == (0, 0):
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child's copy hung")
    assert os.waitstatus_to_exitcode(waited[1]) == 0


def test_the_environment_sets_the_copy_threads() -> None:
    assert host_copy.copy_threads({host_copy.COPY_THREADS_ENV: "3"}) == 3
    assert host_copy.copy_threads({host_copy.COPY_THREADS_ENV: " 1 "}) == 1  # copies stay on their callers
    assert 1 <= host_copy.copy_threads({}) <= 8


@pytest.mark.parametrize("text", ["0", "-2", "four", "2.5", "65"])
def test_a_bad_copy_threads_value_is_ignored_with_a_warning(text: str) -> None:
    with pytest.warns(RuntimeWarning, match=f"CUCTXD_COPY_THREADS='{text}' is not a whole number from 1 to 64"):
        threads = host_copy.copy_threads({host_copy.COPY_THREADS_ENV: text})
    assert threads == host_copy.copy_threads({})


def test_one_copy_thread_keeps_every_copy_on_its_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "COPY_THREADS", 1)
    monkeypatch.setattr(host_copy, "_gang", None)
    source = os.urandom(8 * MiB)
    target = bytearray(len(source))
    host_copy.copy(memoryview(target), memoryview(source))
    assert target == source
    assert host_copy._gang is None  # no thread was started
