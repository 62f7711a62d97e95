"""``--device``'s value (``all``, ``N``, ``N,M``): its syntax checked without a daemon, the devices against the
daemon's count with the error the daemon gives."""

from __future__ import annotations

import pytest

from cuctxd.client.tensors.copies import parse_devices, served_devices
from cuctxd.protos.errors import BadArgument, CudaError


def test_all_one_and_several_in_their_order() -> None:
    assert parse_devices("all") is None
    assert parse_devices("3") == [3]
    assert parse_devices("2,0,1") == [2, 0, 1]
    assert served_devices(None, 2) == [0, 1]
    assert served_devices([1, 0], 2) == [1, 0]


@pytest.mark.parametrize(("text", "said"), [("-1", "must be 0 or more"), ("0,0", "each device once"),
                                            ("1,x", "a device number"), ("", "a device number")])
def test_a_malformed_list_is_a_bad_argument(text: str, said: str) -> None:
    with pytest.raises(BadArgument, match=said):
        parse_devices(text)


def test_a_device_the_daemon_does_not_have_is_cudas_invalid_device() -> None:
    with pytest.raises(CudaError) as raised:
        served_devices([0, 5], 2)
    assert raised.value.name == "CUDA_ERROR_INVALID_DEVICE" and "device 5" in raised.value.message
