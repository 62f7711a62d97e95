"""A checkpoint load that would pass a limit is refused before a byte of it is read, naming the setting to raise;
by default one model may fill a device and outlive its loader's session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cuctxd import Client, CudaError, LimitExceeded
from cuctxd.client.tensors.safetensors_load import load_safetensors
from tests.checkpoint_files import write_shard
from tests.helpers import DaemonProcess

MIB = 1 << 20


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    """40 MiB of weights: more than half of a 64 MiB sim device."""
    return str(write_shard(tmp_path / "model.safetensors", {"w": np.zeros(40 * MIB, np.uint8)}))


def refused_unread(client: Client, checkpoint: str, error: type[Exception], says: str) -> None:
    read: list[int] = []
    with pytest.raises(error, match=says):
        load_safetensors(client, checkpoint, "too-big", progress=lambda done, total: read.append(done))
    assert read == [], "bytes were read before the refusal"
    assert client.list_shared() == []
    assert client.status()["devices"][0]["memory"]["allocated"] == 0


def test_past_max_orphaned_bytes_per_uid_is_refused_before_reading(
        start_daemons: Callable[..., DaemonProcess], checkpoint: str) -> None:
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB",
                           "--max-orphaned-bytes-per-uid", "32MiB")
    with Client(daemon.endpoint) as client:
        refused_unread(client, checkpoint, LimitExceeded,
                       r"raise the daemon's max_orphaned_bytes_per_uid \(--max-orphaned-bytes-per-uid\)")


def test_past_the_session_quota_is_refused_before_reading(start_daemons: Callable[..., DaemonProcess],
                                                          checkpoint: str) -> None:
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB",
                           "--session-quota", "16MiB")
    with Client(daemon.endpoint) as client:
        refused_unread(client, checkpoint, CudaError, r"raise the daemon's session_quota \(--session-quota\)")


def test_by_default_one_model_may_fill_a_device_and_outlive_its_loader(
        start_daemons: Callable[..., DaemonProcess], checkpoint: str) -> None:
    daemon = start_daemons("--sim-devices", "1", "--sim-memory", "64MiB")
    with Client(daemon.endpoint) as loader:
        assert load_safetensors(loader, checkpoint, "fills-it").loaded
    with Client(daemon.endpoint) as later:
        assert [entry["name"] for entry in later.list_shared()] == ["fills-it"]
        assert later.status()["devices"][0]["orphaned"]["bytes"] >= 40 * MIB
