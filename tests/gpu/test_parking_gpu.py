"""Parking on a real GPU: a layout in a pool of its own parked in the fd store (tests/service_manager.py stands
in for systemd) survives a SIGKILL of the daemon; a worker started after the restart computes with it, a worker
that mapped it before keeps computing, and unpublishing after the restart gives the memory back. A 48 MiB layout
(VMM memory) is parked and re-adopted beside it."""

from __future__ import annotations

import time

import pytest

from cuctxd import Client, NotFound, NotParked
from tests.helpers import run_client, spawn_client, wait_for_line
from tests.service_manager import ServiceManager

PRODUCER = """
import torch
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import publish_state_dict
weights = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32), "b": torch.ones(7, device="cuda")}
with Client(ENDPOINT) as c:
    publish_state_dict(c, "parked-weights", weights)
    big = {"w": torch.ones(48 << 20, device="cuda", dtype=torch.uint8)}  # above POOL_BUFFER_MAX: VMM memory
    publish_state_dict(c, "big-weights", big)
print("published", flush=True)
"""

WORKER = """
import torch
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import load_state_dict
with Client(ENDPOINT) as c, load_state_dict(c, "parked-weights") as loaded:
    print("sum", loaded.state_dict["w"].double().sum().item(), loaded.state_dict["b"].sum().item(), flush=True)
"""

OLD_WORKER = """
import os, time, torch
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import load_state_dict
c = Client(ENDPOINT)
loaded = load_state_dict(c, "parked-weights")
w = loaded.state_dict["w"]
print("ready", w.double().sum().item(), flush=True)
while not os.path.exists(GO):  # the daemon is killed and restarted meanwhile
    time.sleep(0.05)
print("after", w.double().sum().item(), flush=True)
"""

EXPECTED = str(float(sum(range(1 << 20))))


def test_a_parked_layout_survives_a_sigkill_on_the_gpu(manager: ServiceManager) -> None:
    daemon = manager.start(backend="cuda", ready_timeout=120)
    with Client(daemon.endpoint) as c:
        free_at_start = c.mem_get_info()[0]
    run_client(PRODUCER, daemon.endpoint, timeout=300)
    names = manager.names()  # the 48 MiB one too: VMM memory has an fd (else its publish failed, NOT_PARKED)
    assert len([n for n in names if n.startswith("cuctxd-share-")]) == 2
    assert len([n for n in names if n.startswith("cuctxd-record-")]) == 2
    go = manager.workdir / "go"
    old = spawn_client(f"GO = {str(go)!r}\n{OLD_WORKER}", daemon.endpoint)
    try:
        assert wait_for_line(old, "ready", 120).split()[1] == EXPECTED
        daemon = manager.restart(backend="cuda", ready_timeout=120)
        ready = time.monotonic()
        with Client(daemon.endpoint) as c:
            assert sorted(s["name"] for s in c.list_shared()) == ["big-weights", "parked-weights"], daemon.log()[-4000:]
            assert time.monotonic() - ready < 1.0
            out = run_client(WORKER, daemon.endpoint, timeout=300)
            assert next(line for line in out.splitlines() if line.startswith("sum")).split()[1:] == [EXPECTED, "7.0"]
            go.touch()
            assert wait_for_line(old, "after", 60).split()[1] == EXPECTED
            c.unpublish("parked-weights")
            c.unpublish("big-weights")
            deadline = time.monotonic() + 10
            while c.mem_get_info()[0] < free_at_start - (64 << 20) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.mem_get_info()[0] >= free_at_start - (64 << 20), "the unpublished memory was not given back"
        assert not [n for n in manager.names() if n.startswith("cuctxd-share-")]
    finally:
        old.kill()
        old.communicate(timeout=30)


def test_a_persistent_legacy_buffer_is_refused_by_name_on_the_gpu(manager: ServiceManager) -> None:
    """cuMemAlloc memory (above POOL_BUFFER_MAX, not shareable) has no fd to park: a persistent publish of it fails
    with NOT_PARKED and names nothing; published without persistent, it is named."""
    daemon = manager.start(backend="cuda", ready_timeout=120)
    with Client(daemon.endpoint) as c:
        legacy = c.alloc(48 << 20)
        with pytest.raises(NotParked, match="shareable=True"):
            c.publish(legacy, "legacy", persistent=True)
        with pytest.raises(NotFound):
            c.lookup("legacy")
        c.publish(legacy, "legacy")
        assert c.lookup("legacy").mechanism == "ipc"
        c.unpublish("legacy")
    assert not [n for n in manager.names() if n.startswith("cuctxd-")]
