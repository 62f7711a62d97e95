"""VMM memory on a real GPU: the mechanism alone (the daemon backend's ``cuMemCreate`` allocation exported as a
POSIX fd, imported by the client's ctypes driver in a child process, both sides seeing each other's writes), and a
shareable buffer above POOL_BUFFER_MAX published persistent under the service-manager helper, mapped by a torch
consumer, surviving a SIGKILL of the daemon, opened by a new consumer after the restart, and given back by
``unpublish``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cuctxd import Client
from tests.helpers import (
    REPO,
    client_env,
    primary_current,
    run_client,
    spawn_client,
    wait_for_line,
)
from tests.service_manager import ServiceManager

MIB = 1 << 20

CHILD = """
import ctypes, os, sys
from cuctxd.client.data_plane.cuda_driver import driver
fd, size, uuid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cu = driver("test")
device = cu.find_device(uuid)
context = cu.retain_primary(device)
with cu.current(context):
    ptr, handle = cu.vmm_import(fd, size, device)
os.close(fd)
import torch  # the import's pointer in torch, through the CUDA array interface
class Interface:
    __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                "strides": None}
tensor = torch.as_tensor(Interface(), device=f"cuda:{device}")
print("read", tensor[:4].tolist(), int(tensor[-1].item()), flush=True)
tensor[4:8] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8, device=tensor.device)
torch.cuda.synchronize()
del tensor
with cu.current(context):
    cu.vmm_unmap(ptr, size, handle)
cu.release_primary(device)
print("done", flush=True)
"""


def test_a_vmm_allocation_is_imported_from_its_fd_in_another_process() -> None:
    from cuctxd.daemon.backends.cuda import CudaDriver

    driver = CudaDriver()
    driver.init()
    if not driver.vmm_supported(0):
        pytest.skip("device 0 has no VMM with POSIX file descriptors")
    granularity = driver.vmm_granularity(0)
    size = -(-(64 * MIB + 1) // granularity) * granularity
    uuid = driver.device_info(0).uuid
    with primary_current(driver):
        free = driver.mem_get_info()[0]
        ptr = driver.vmm_alloc(0, size)
        try:
            assert driver.mem_get_info()[0] <= free - size
            driver.memset_d8(ptr, 0, size)
            driver.memcpy_htod(ptr, memoryview(bytes([1, 2, 3, 4])), 4)
            driver.memset_d8(ptr + size - 1, 42, 1)
            fd = driver.vmm_export_fd(ptr)
            try:
                done = subprocess.run([sys.executable, "-c", CHILD, str(fd), str(size), uuid], pass_fds=(fd,),
                                      capture_output=True, text=True, env=client_env(), cwd=REPO, timeout=120)
            finally:
                os.close(fd)
            assert done.returncode == 0, done.stderr
            assert "read [1, 2, 3, 4] 42" in done.stdout and "done" in done.stdout, done.stdout
            out = bytearray(8)
            driver.memcpy_dtoh(memoryview(out), ptr, 8)
            assert bytes(out) == bytes([1, 2, 3, 4, 9, 8, 7, 6])  # the child's write, through its own mapping
        finally:
            driver.vmm_free(ptr)
        deadline = time.monotonic() + 10
        while driver.mem_get_info()[0] < free - 16 * MIB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.mem_get_info()[0] >= free - 16 * MIB, "the released VMM memory was not given back"


#: A 96 MiB layout: one shareable buffer above POOL_BUFFER_MAX, so VMM memory.
PRODUCER = """
import torch
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import publish_state_dict
weights = {"w": torch.arange(24 << 20, device="cuda", dtype=torch.float32), "b": torch.ones(7, device="cuda")}
with Client(ENDPOINT) as c:
    publish_state_dict(c, "vmm-weights", weights)
    print("mechanism", c.lookup("vmm-weights").mechanism, flush=True)
"""

#: Opens the share, maps it as one torch tensor (torch.as_tensor on the opened share) and prints checksums.
CONSUMER = """
import hashlib, os, time, torch
from cuctxd import Client
c = Client(ENDPOINT)
share = c.open_shared("vmm-weights")
tensor = torch.as_tensor(share, device="cuda")
def sums():
    return f"{share.descriptor.mechanism} {tensor.to(torch.int64).sum().item()} " \\
           f"{hashlib.sha256(tensor[:1 << 20].cpu().numpy().tobytes()).hexdigest()}"
print("ready", sums(), flush=True)
if WAIT:
    while not os.path.exists(GO):  # the daemon is killed and restarted meanwhile
        time.sleep(0.05)
    print("after", sums(), flush=True)
    os._exit(0)  # its session went with the old daemon: nothing to close there
else:
    del tensor
    share.close()
    c.close()
"""


def consumer(go: object, wait: bool) -> str:
    return f"GO = {str(go)!r}\nWAIT = {wait!r}\n{CONSUMER}"


def wait_for_free(client: Client, at_least: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (free := client.mem_get_info()[0]) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def test_a_vmm_share_survives_a_sigkill_with_a_torch_consumer(manager: ServiceManager) -> None:
    daemon = manager.start(backend="cuda", ready_timeout=120)
    with Client(daemon.endpoint) as c:
        free_at_start = c.mem_get_info()[0]
    assert "mechanism vmm" in run_client(PRODUCER, daemon.endpoint, timeout=300)
    assert [n for n in manager.names() if n.startswith("cuctxd-share-")], daemon.log()
    go = manager.workdir / "go"
    old = spawn_client(consumer(go, wait=True), daemon.endpoint)
    try:
        before = wait_for_line(old, "ready", 120).split()[1:]
        assert before[0] == "vmm"
        with Client(daemon.endpoint) as c:
            free_before_kill = c.mem_get_info()[0]

        daemon = manager.restart(backend="cuda", ready_timeout=120)
        ready = time.monotonic()
        with Client(daemon.endpoint) as c:
            assert [s["name"] for s in c.list_shared()] == ["vmm-weights"]
            assert time.monotonic() - ready < 1.0
            assert c.lookup("vmm-weights").mechanism == "vmm"
            assert c.mem_get_info()[0] >= free_before_kill - 32 * MIB  # adopted, not allocated twice
            new = run_client(consumer(go, wait=False), daemon.endpoint, timeout=300)
            assert next(line for line in new.splitlines() if line.startswith("ready")).split()[1:] == before
            go.touch()
            assert wait_for_line(old, "after", 60).split()[1:] == before  # the old mapping outlived its daemon
            assert old.wait(60) == 0

            c.unpublish("vmm-weights")
            free = wait_for_free(c, free_at_start - 32 * MIB)
            assert free >= free_at_start - 32 * MIB, f"the unpublished memory was not given back: {free}"
        assert not [n for n in manager.names() if n.startswith("cuctxd-share-")]
        assert "adopted 1 parked share(s)" in daemon.log()
    finally:
        old.kill()
        old.communicate(timeout=30)
