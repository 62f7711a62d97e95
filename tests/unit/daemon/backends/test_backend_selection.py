"""Backend selection, and the parts of the cuda backend that can be checked without a GPU.

Which tests run depends on one capability check, whether ``libcuda.so`` loads:
without it ``auto`` must fall back to ``sim`` and ``cuda`` must refuse; with it
(tests marked ``gpu``) ``auto`` must pick ``cuda``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cuda.bindings import driver as cu

from cuctxd.daemon.backends import BackendUnavailable, select_backend
from cuctxd.daemon.backends import cuda as cuda_backend
from cuctxd.daemon.backends.cuda import CudaDriver, check_result, format_uuid
from cuctxd.protos.errors import CudaError
from tests.helpers import cuda_driver_loads

SIM_DEVICES = 3
SIM_MEMORY = 1 << 20


HAVE_DRIVER = cuda_driver_loads()
needs_no_driver = pytest.mark.skipif(HAVE_DRIVER, reason="the CUDA driver is installed here")
needs_driver = pytest.mark.skipif(not HAVE_DRIVER, reason="no CUDA driver (libcuda.so) here")


# --- select_backend ----------------------------------------------------------------------


@needs_no_driver
def test_auto_without_a_driver_falls_back_to_sim_and_says_why() -> None:
    driver, reason = select_backend("auto", sim_devices=SIM_DEVICES, sim_memory=SIM_MEMORY)
    assert driver.name == "sim"
    assert driver.device_count() == SIM_DEVICES
    assert "libcuda.so not found" in reason
    assert "3 simulated device(s)" in reason


@needs_no_driver
def test_cuda_by_name_without_a_driver_raises_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match=r"backend 'cuda' was requested but is unavailable") as info:
        select_backend("cuda", sim_devices=SIM_DEVICES, sim_memory=SIM_MEMORY)
    assert "libcuda.so not found" in str(info.value)
    assert "'sim'" in str(info.value)


def test_sim_by_name_builds_the_requested_devices() -> None:
    driver, reason = select_backend("sim", sim_devices=SIM_DEVICES, sim_memory=SIM_MEMORY)
    assert driver.name == "sim"
    assert driver.device_count() == SIM_DEVICES
    assert driver.device_info(0).total_memory == SIM_MEMORY
    assert "requested" in reason


@pytest.mark.parametrize("name", ["", "CUDA", "gpu", "sim "])
def test_unknown_backend_name_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(name, sim_devices=SIM_DEVICES, sim_memory=SIM_MEMORY)


@pytest.mark.gpu
@needs_driver
def test_auto_with_a_driver_picks_cuda() -> None:
    driver, reason = select_backend("auto", sim_devices=SIM_DEVICES, sim_memory=SIM_MEMORY)
    assert driver.name == "cuda"
    assert driver.device_count() >= 1
    assert "CUDA driver" in reason


# --- the result checker ------------------------------------------------------------------


def test_check_result_unwraps_success() -> None:
    ok = cu.CUresult.CUDA_SUCCESS
    assert check_result((ok,)) is None
    assert check_result((ok, 7)) == 7
    assert check_result((ok, 1, 0)) == (1, 0)


def test_check_result_raises_cuda_error_with_name_and_message() -> None:
    with pytest.raises(CudaError) as info:
        check_result((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None))
    assert info.value.code == 2
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.message == "out of memory"


def test_check_result_names_a_code_missing_from_our_table() -> None:
    with pytest.raises(CudaError) as info:
        check_result((cu.CUresult.CUDA_ERROR_FILE_NOT_FOUND, None))
    assert info.value.code == 301
    assert info.value.name == "CUDA_ERROR_FILE_NOT_FOUND"


# --- cuda backend pieces that need no device ---------------------------------------------


def test_contexts_compare_and_hash_by_native_handle() -> None:
    """The worker asks "already current?" with ``==`` and keys dicts by context."""
    assert cu.CUcontext(0x5000) == cu.CUcontext(0x5000)
    assert hash(cu.CUcontext(0x5000)) == hash(cu.CUcontext(0x5000))
    assert cu.CUcontext(0x5000) != cu.CUcontext(0x6000)


def test_uuid_is_formatted_like_nvidia_smi() -> None:
    raw = bytes.fromhex("0123456789abcdef00112233445566ff")
    assert format_uuid(raw) == "GPU-01234567-89ab-cdef-0011-2233445566ff"


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.memcpy_dtoh(memoryview(bytes(16)), 0x1000, 16),
        lambda d: d.memcpy_dtoh(bytes(16), 0x1000, 16),
        lambda d: d.memcpy_dtoh(memoryview(bytearray(8)), 0x1000, 16),
        lambda d: d.memcpy_htod(0x1000, memoryview(bytes(8)), 16),
        lambda d: d.memcpy_htod(0x1000, memoryview(bytes(8)), -1),
        lambda d: d.memcpy_htod(0x1000, memoryview(bytearray(32))[::2], 16),
        lambda d: d.memset_d8(0x1000, 256, 16),
    ],
    ids=[
        "dtoh-read-only", "dtoh-bytes", "dtoh-short", "htod-short", "htod-negative", "htod-strided",
        "memset-not-a-byte",
    ],
)
def test_bad_host_arguments_are_refused_before_the_driver(call: Any) -> None:
    with pytest.raises(CudaError) as info:
        call(CudaDriver())
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


_CTX = cu.CUcontext(0x5000)
_EVERY_CALL: dict[str, Callable[[CudaDriver], Any]] = {
    "init": lambda d: d.init(),
    "driver_version": lambda d: d.driver_version(),
    "device_count": lambda d: d.device_count(),
    "device_info": lambda d: d.device_info(0),
    "primary_ctx_retain": lambda d: d.primary_ctx_retain(0),
    "primary_ctx_release": lambda d: d.primary_ctx_release(0),
    "primary_ctx_state": lambda d: d.primary_ctx_state(0),
    "ctx_create": lambda d: d.ctx_create(0, 0),
    "ctx_destroy": lambda d: d.ctx_destroy(_CTX),
    "ctx_push": lambda d: d.ctx_push(_CTX),
    "ctx_pop": lambda d: d.ctx_pop(),
    "ctx_set_current": lambda d: d.ctx_set_current(_CTX),
    "ctx_set_current-None": lambda d: d.ctx_set_current(None),
    "ctx_get_current": lambda d: d.ctx_get_current(),
    "ctx_get_device": lambda d: d.ctx_get_device(),
    "ctx_get_flags": lambda d: d.ctx_get_flags(),
    "ctx_get_api_version": lambda d: d.ctx_get_api_version(_CTX),
    "ctx_get_id": lambda d: d.ctx_get_id(_CTX),
    "ctx_synchronize": lambda d: d.ctx_synchronize(),
    "mem_alloc": lambda d: d.mem_alloc(4096),
    "mem_free": lambda d: d.mem_free(0x1000),
    "mem_get_info": lambda d: d.mem_get_info(),
    "memset_d8": lambda d: d.memset_d8(0x1000, 0xAB, 16),
    "memcpy_htod": lambda d: d.memcpy_htod(0x1000, memoryview(bytes(16)), 16),
    "memcpy_dtoh": lambda d: d.memcpy_dtoh(memoryview(bytearray(16)), 0x1000, 16),
    "memcpy_dtod": lambda d: d.memcpy_dtod(0x2000, 0x1000, 16),
}


@needs_no_driver
@pytest.mark.parametrize("call", list(_EVERY_CALL.values()), ids=list(_EVERY_CALL))
def test_call_passes_argument_conversion_and_reaches_the_driver(
    call: Callable[[CudaDriver], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bindings convert arguments before loading libcuda.so: a malformed call is a
    TypeError here, a well-formed one the RuntimeError of the missing driver.
    ``cuDeviceGet`` is faked so device-taking calls get a real ``CUdevice`` to convert."""
    def device_get(ordinal: int) -> tuple[Any, Any]:
        return cu.CUresult.CUDA_SUCCESS, cu.CUdevice(ordinal)

    monkeypatch.setattr(cuda_backend, "cuDeviceGet", device_get)
    with pytest.raises(RuntimeError):
        call(CudaDriver())
