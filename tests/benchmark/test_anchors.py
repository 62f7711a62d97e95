"""The bench's anchor servers answer as the figures assume: real spawned processes, real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.anchors import AnchorDevice, AnchorServer, AnchorUnavailable, RawClient, pattern, start_anchor


@pytest.fixture
def device_anchor(tmp_path: Path) -> Iterator[AnchorServer]:
    anchor = start_anchor(f"ipc://{tmp_path}/a.sock", device=AnchorDevice("sim"))
    try:
        yield anchor
    finally:
        anchor.stop()


def test_device_anchor_replies_with_the_bytes_it_read_from_the_device(device_anchor: AnchorServer) -> None:
    out = bytearray(64)
    with RawClient(device_anchor.ipc) as client:
        assert client.call("source", {"size": 64}, into=out) == {"size": 64}
    assert out == pattern(64)


def test_device_anchor_caps_a_reply_at_its_device_buffer(device_anchor: AnchorServer) -> None:
    with RawClient(device_anchor.ipc) as client:
        assert client.call("source", {"size": 1 << 30})["size"] == 1 << 20


def test_a_device_that_cannot_open_is_reported_not_hung(tmp_path: Path) -> None:
    with pytest.raises(AnchorUnavailable, match="could not open its device"):
        no_such_gpu = AnchorDevice("cuda", "GPU-00000000-0000-0000-0000-000000000000")
        start_anchor(f"ipc://{tmp_path}/a.sock", device=no_such_gpu)
