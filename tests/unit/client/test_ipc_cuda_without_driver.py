"""Without an NVIDIA driver, the client's cuda mapping code says so with a typed error, and leaves
the caller's fd alone."""

from __future__ import annotations

import os

import pytest

from cuctxd.client.data_plane.ipc_cuda import CudaPoolImport, copy_device_to_device
from cuctxd.protos.errors import NotShareable
from tests.helpers import cuda_driver_loads


@pytest.fixture(autouse=True)
def no_driver() -> None:
    if cuda_driver_loads():
        pytest.skip("a CUDA driver is installed here")


def test_a_pool_import_says_why_and_keeps_the_fd_open() -> None:
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(NotShareable, match="cannot load the CUDA driver to map a cuda share"):
            CudaPoolImport(read_end, "GPU-00000000-0000-0000-0000-000000000000")
        os.fstat(read_end)  # still the caller's to close
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_device_copy_says_why() -> None:
    with pytest.raises(NotShareable, match="to copy device memory"):
        copy_device_to_device("GPU-00000000-0000-0000-0000-000000000000", [(0, 0, 1)])
