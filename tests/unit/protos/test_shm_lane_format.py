"""The shm lane's message layout: what one side writes the other reads back, and lengths that do not
fit an area are refused, not read past."""

from __future__ import annotations

import pytest

from cuctxd.protos.errors import BadRequest
from cuctxd.protos.shm_lane import (
    AREA_BYTES,
    MAX_MESSAGE_BYTES,
    MESSAGE_HEAD,
    REGION_BYTES,
    REPLY_AT,
    fits,
    read_message,
    write_message,
)


@pytest.fixture
def region() -> memoryview:
    return memoryview(bytearray(REGION_BYTES))


@pytest.mark.parametrize("payload", [None, b"", b"x" * 1000])
def test_a_message_reads_back_as_written(region: memoryview, payload: bytes | None) -> None:
    write_message(region, REPLY_AT, 7, b"\x81\xa2id\x01", payload)
    assert read_message(region, REPLY_AT) == (7, b"\x81\xa2id\x01", payload)


def test_the_largest_message_fits_and_one_byte_more_does_not() -> None:
    assert fits(10, MAX_MESSAGE_BYTES - 10) and not fits(10, MAX_MESSAGE_BYTES - 9)
    assert MAX_MESSAGE_BYTES + MESSAGE_HEAD.size == AREA_BYTES


@pytest.mark.parametrize(("header", "frames", "size"), [(AREA_BYTES, 0, 0), (10, 1, AREA_BYTES), (10, 2, 0),
                                                        (10, 0, 5), (2**32 - 1, 1, 2**32 - 1)])
def test_lengths_that_do_not_fit_are_refused(region: memoryview, header: int, frames: int, size: int) -> None:
    MESSAGE_HEAD.pack_into(region, 0, 1, header, frames, size)
    with pytest.raises(BadRequest, match="do not fit"):
        read_message(region, 0)
