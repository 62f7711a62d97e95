"""The daemon end to end on a real GPU: CUDA semantics, memory, streams, sharing, zero-copy."""

from __future__ import annotations

import pytest

from cuctxd.client import Client, CudaError, UnknownHandle
from tests.helpers import DaemonProcess, run_client, spawn_client, wait_for_line, wait_until

MIB = 1 << 20


def test_sample_program_sequence(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as c:
        assert c.backend == "cuda"
        assert c.current_context(0) is None
        assert c.device_count() >= 1
        assert c.current_context(0) is None
        primary = c.set_device(0)
        assert primary.is_primary and c.current_context(0) == primary
        assert c.get_device() == 0
        assert primary.api_version >= 3020


def test_memory_streams_and_errors(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as c:
        payload = bytes(range(256)) * 4096
        pooled, plain = c.alloc(MIB), c.alloc(MIB, shareable=True)
        pooled.write(payload)
        pooled.copy_to(plain)
        assert plain.read() == payload
        plain.fill(7, offset=10, size=5)
        assert plain.read(20)[8:17] == payload[8:10] + b"\x07" * 5 + payload[15:17]
        stream = c.create_stream(0)
        start, end = c.create_event(0), c.create_event(0)
        big = c.alloc(256 * MIB)
        start.record(stream)
        for _ in range(4):
            big.fill(1, stream=stream)
        end.record(stream)
        stream.synchronize()
        assert start.elapsed_time(end) > 0
        assert big.read(4, offset=256 * MIB - 4, stream=stream) == b"\x01" * 4
        large = bytes(range(256)) * (40 * MIB // 256)
        big.write(large)
        out = bytearray(len(large))
        big.read_into(out)
        assert out == large
        ctx = c.create_context(0)
        assert [x.is_primary for x in c.context_stack(0)] == [True, False]
        inner = c.alloc(4096)
        assert inner.context == ctx.handle
        c.pop_context(0)
        ctx.destroy()
        with pytest.raises(UnknownHandle) as gone:
            inner.read(4)
        assert gone.value.name == "CUCTXD_ERROR_UNKNOWN_HANDLE"
        with pytest.raises(CudaError) as oom:
            c.alloc(1 << 50)
        assert oom.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        free, total = c.mem_get_info(0)
        assert 0 < free <= total


ZERO_COPY_CONSUMER = """
import cupy, torch
from cuctxd.client import Client
with Client(ENDPOINT) as c, c.open_shared("gpu-weights") as shared:
    t = torch.as_tensor(shared, device="cuda")
    a = cupy.asarray(shared)
    same = t.data_ptr() == shared.ptr == a.data.ptr
    print("zero-copy", same, int(t[:16].sum()), int(a[-1]))
    t[0:4] = 42
    torch.cuda.synchronize()
"""


def test_sharing_zero_copy_with_cupy_and_torch(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as owner:
        buf = owner.alloc(MIB, shareable=True)
        data = bytes([3]) * (MIB - 1) + bytes([9])
        buf.write(data)
        owner.publish(buf, "gpu-weights")
        out = run_client(ZERO_COPY_CONSUMER, cuda_daemon.endpoint, timeout=120)
        line = next(x for x in out.splitlines() if x.startswith("zero-copy"))
        assert line.split()[1:] == ["True", str(3 * 16), "9"]
        assert buf.read(6) == bytes([42] * 4 + [3, 3])  # written by the other process, seen here
        owner.unpublish("gpu-weights")


PRODUCER = """
from cuctxd.client import Client
with Client(ENDPOINT) as c:
    buf = c.alloc(4096, shareable=True)
    buf.write(b"produced" * 512)
    c.publish(buf, "handoff", once=True)
"""

CONSUMER = """
import ctypes
from cuda.bindings import driver as cu
from cuctxd.client import Client
with Client(ENDPOINT) as c, c.open_shared("handoff") as shared:
    host = bytearray(16)
    cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
    err, = cu.cuMemcpyDtoH(host, shared.ptr, 16)
    print("read", err == cu.CUresult.CUDA_SUCCESS, bytes(host).decode())
"""


def test_published_buffer_outlives_its_producer_on_cuda(cuda_daemon: DaemonProcess) -> None:
    """A consume-once name (``once=True``) keeps the buffer past its producer until its one consumer is done."""
    with Client(cuda_daemon.endpoint) as observer:
        run_client(PRODUCER, cuda_daemon.endpoint, timeout=120)
        out = run_client(CONSUMER, cuda_daemon.endpoint, timeout=120)
        assert "read True producedproduced" in out
        assert observer.list_shared() == []
        assert all(dev["shares"] == [] for dev in observer.status()["devices"])


VICTIM = """
from cuctxd.client import Client
import time
c = Client(ENDPOINT)
c.create_context(0)
c.alloc(512 * 1024 * 1024)
print("ready", c.session_id, flush=True)
time.sleep(600)
"""


def test_sigkilled_client_memory_comes_back(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as observer:
        before = observer.memory_info(0)["device_free"]
        with spawn_client(VICTIM, cuda_daemon.endpoint) as victim:
            wait_for_line(victim, "ready", timeout=120)
            assert observer.memory_info(0)["device_free"] < before - 256 * MIB
            victim.kill()
        assert wait_until(lambda: len(observer.status()["sessions"]) == 1, 15, 0.1), observer.status()["sessions"]
        assert observer.memory_info(0)["device_free"] >= before - 64 * MIB
