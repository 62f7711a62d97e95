"""The backends behind :class:`~cuctxd.daemon.backends.base.Driver`, and the choice between them.

``cuda`` drives real GPUs; ``sim`` simulates devices in host memory with CUDA's
semantics and error codes. :func:`select_backend` is the one place that decides,
at daemon start, which one the device workers get.
"""

from __future__ import annotations

import os

from cuctxd.daemon.backends.base import Driver
from cuctxd.protos.errors import CudaError
from cuctxd.protos.sizes import human_size

#: Values of the daemon's ``backend`` setting.
BACKEND_NAMES = ("auto", "cuda", "sim")


class BackendUnavailable(Exception):
    """The ``cuda`` backend was asked for by name but cannot run on this machine."""


def select_backend(name: str, *, sim_devices: int, sim_memory: int, sim_vmm: bool = True) -> tuple[Driver, str]:
    """The initialised driver for backend ``name`` and a one-line reason for the log.

    ``auto`` takes ``cuda`` when the driver loads, initialises and sees at least
    one device, and otherwise falls back to ``sim``, saying why. ``cuda`` raises
    :class:`BackendUnavailable` instead of falling back. ``sim`` builds
    ``sim_devices`` simulated devices of ``sim_memory`` bytes each, with VMM unless not ``sim_vmm``.
    Raises ValueError for any other name.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name == "sim":
        return _sim(sim_devices, sim_memory, sim_vmm), f"requested, {_sim_shape(sim_devices, sim_memory)}"
    try:
        return _cuda()
    except BackendUnavailable as unavailable:
        if name == "cuda":
            raise BackendUnavailable(
                f"backend 'cuda' was requested but is unavailable: {unavailable}"
                " (backend 'auto' or 'sim' runs without a GPU)"
            ) from unavailable
        reason = f"cuda unavailable ({unavailable}), so {_sim_shape(sim_devices, sim_memory)}"
        return _sim(sim_devices, sim_memory, sim_vmm), reason


def _cuda() -> tuple[Driver, str]:
    """An initialised :class:`CudaDriver` that sees devices, or BackendUnavailable saying why not."""
    try:
        from cuctxd.daemon.backends.cuda import CudaDriver
    except ImportError as missing:
        raise BackendUnavailable(f"cuda-python is not importable: {missing}") from missing
    driver = CudaDriver()
    try:
        driver.init()
        count = driver.device_count()
        version = driver.driver_version()
    except CudaError as failed:
        raise BackendUnavailable(f"the CUDA driver failed to initialise: {failed}") from failed
    except RuntimeError as not_loaded:  # cuda.pathfinder's DynamicLibNotFoundError is one
        raise BackendUnavailable(f"libcuda.so not found or not loadable: {not_loaded}") from not_loaded
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise BackendUnavailable(f"the CUDA driver sees no devices{where}")
    return driver, f"{count} device(s), CUDA driver {version // 1000}.{version % 1000 // 10}"


def _sim(devices: int, memory: int, vmm: bool) -> Driver:
    from cuctxd.daemon.backends.sim import SimDriver

    driver = SimDriver(device_count=devices, memory_per_device=memory, vmm=vmm)
    driver.init()
    return driver


def _sim_shape(devices: int, memory: int) -> str:
    return f"{devices} simulated device(s) of {human_size(memory)}"
