"""Serving some of the machine's devices: ``devices = [2, 0]`` shows ordinals 2 and 0 as devices 0 and 1.

Everything above the driver (workers, handlers, replies, clients) numbers
devices 0..n-1; :class:`DeviceSubset` is the one place that turns such an index
into the driver's ordinal and back, so no other layer has two numberings to keep
apart. Device UUIDs and PCI bus ids are the physical ones, which is what a
client uses to find the same GPU in its own process.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

from cuctxd.daemon.backends.base import Driver
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import CudaError
from cuctxd.protos.records import DeviceInfo


class DeviceSubset:
    """Wraps a :class:`Driver`; any method with an ``ordinal`` parameter gets the physical ordinal.

    Use :meth:`wrap` to get it typed as a Driver. Thread-safe as far as the
    wrapped driver is: it holds no state of its own beyond the mapping.
    """

    def __init__(self, driver: Driver, ordinals: Sequence[int]) -> None:
        count = driver.device_count()
        bad = [o for o in ordinals if o >= count]
        if bad:
            raise ValueError(f"no device with ordinal {bad[0]}: the {driver.name} driver sees {count} device(s)")
        self._driver = driver
        self.ordinals = tuple(ordinals)
        self._index_of = {ordinal: index for index, ordinal in enumerate(self.ordinals)}
        self._wrapped: dict[str, Callable[..., Any]] = {}

    @classmethod
    def wrap(cls, driver: Driver, ordinals: Sequence[int]) -> Driver:
        return cast(Driver, cls(driver, ordinals))

    def physical(self, index: int) -> int:
        if not 0 <= index < len(self.ordinals):
            raise CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {index}")
        return self.ordinals[index]

    def device_count(self) -> int:
        return len(self.ordinals)

    def device_info(self, ordinal: int) -> DeviceInfo:
        return dataclasses.replace(self._driver.device_info(self.physical(ordinal)), index=ordinal)

    def ctx_get_device(self) -> int:
        ordinal = self._driver.ctx_get_device()
        if ordinal not in self._index_of:
            raise CudaError.of(CUresult.CUDA_ERROR_INVALID_DEVICE, f"ordinal {ordinal} is not served")
        return self._index_of[ordinal]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._driver, name)
        if not callable(attr):
            return attr
        wrapped = self._wrapped.get(name)
        if wrapped is None:
            wrapped = self._wrapped[name] = self._map_ordinal(attr)
        return wrapped

    def _map_ordinal(self, method: Callable[..., Any]) -> Callable[..., Any]:
        try:
            parameters = list(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            return method
        if "ordinal" not in parameters:
            return method
        position = parameters.index("ordinal")

        def call(*args: Any, **kwargs: Any) -> Any:
            if "ordinal" in kwargs:
                kwargs["ordinal"] = self.physical(kwargs["ordinal"])
            elif len(args) > position:
                args = (*args[:position], self.physical(args[position]), *args[position + 1:])
            return method(*args, **kwargs)

        return call
