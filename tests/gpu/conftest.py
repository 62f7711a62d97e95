"""GPU-only tests: a real cuctxd on the cuda backend; skipped with the reason without a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import DaemonProcess, cuda_unavailable_reason, remove_tempdir, short_tempdir, start_daemon
from tests.service_manager import ServiceManager


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = cuda_unavailable_reason()
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"cuda backend: {reason}"))


@pytest.fixture(scope="module")
def cuda_daemon() -> Iterator[DaemonProcess]:
    process = start_daemon("--lease-ttl", "3", backend="cuda", ready_timeout=120)
    yield process
    code = process.stop(timeout=60)
    remove_tempdir(process.socket_dir)
    assert code == 0, f"cuctxd exited with {code}:\n{process.log()}"


@pytest.fixture
def manager() -> Iterator[ServiceManager]:
    """The test service manager (:mod:`tests.service_manager`) of one test, in a short temporary directory."""
    directory = short_tempdir()
    service = ServiceManager(directory)
    yield service
    service.close(timeout=60)
    remove_tempdir(directory)
