"""The data plane on a real GPU: shareable buffers (VMM allocations of their own) into torch, host buffers by DMA,
the staging ring, stream-ordered allocation; a real daemon on the cuda backend and real client processes."""

from __future__ import annotations

import numpy as np

from cuctxd.client import Client
from tests.helpers import DaemonProcess, pattern, run_client

MIB = 1 << 20

TORCH_CONSUMER = """
import torch
from cuctxd.client import Client
with Client(ENDPOINT) as c, c.open_shared("shared-weights") as s:
    assert s.descriptor.mechanism == "vmm", s.descriptor.mechanism
    t = torch.as_tensor(s, device="cuda").view(torch.float32)
    print("sum", float(t.sum()))
    t[:4] = 2.0
    torch.cuda.synchronize()
"""


def test_a_shareable_buffer_is_shared_into_torch_as_its_own_vmm_allocation(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as owner:
        buf = owner.alloc(4 * MIB, shareable=True)
        buf.write(np.ones(MIB, dtype=np.float32).tobytes())
        owner.publish(buf, "shared-weights")
        out = run_client(TORCH_CONSUMER, cuda_daemon.endpoint, timeout=120)
        assert f"sum {float(MIB)}" in out
        assert np.frombuffer(buf.read(16), dtype=np.float32).tolist() == [2.0] * 4
        owner.unpublish("shared-weights")


def test_opening_shared_buffers_each_its_own_vmm_allocation(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as owner, Client(cuda_daemon.endpoint) as consumer:
        buffers = [owner.alloc(MIB, shareable=True) for _ in range(3)]
        for i, buf in enumerate(buffers):
            buf.fill(i + 1)
        descriptors = [owner.export(buf) for buf in buffers]
        assert all(d.mechanism == "vmm" and d.allocation_size == 2 * MIB for d in descriptors)
        shares = [consumer.open_shared(d) for d in descriptors]
        assert len({s.ptr for s in shares}) == 3
        assert [share.read(1) for share in shares] == [bytes([i + 1]) for i in range(3)]
        for share in shares:
            share.close()


def test_host_buffers_move_bytes_by_dma(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as c:
        host = c.host_alloc(64 * MIB)
        view = np.asarray(host)
        view[:] = np.frombuffer(pattern(64 * MIB), dtype=np.uint8)
        buf = c.alloc(64 * MIB)
        assert c.write(buf, host) == 64 * MIB
        view[:] = 0
        assert c.read_into(buf, host) == 64 * MIB
        assert bytes(view[:4096]) == pattern(64 * MIB)[:4096]
        stream = c.create_stream()
        buf.fill(5, stream=stream)
        buf.read_into(host, stream=stream)
        stream.synchronize()
        assert int(view[-1]) == 5
        del view
        host.free()


def test_the_staging_ring_carries_large_transfers_intact(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as c:
        data = pattern(64 * MIB + 4096)
        buf = c.alloc(len(data))
        assert buf.write(data) == len(data)
        out = bytearray(len(data))
        assert buf.read_into(out) == len(data)
        assert out == data


def test_alloc_async_in_a_loop_and_a_failure_at_synchronize(cuda_daemon: DaemonProcess) -> None:
    with Client(cuda_daemon.endpoint) as c:
        for _ in range(1000):
            c.free_async(c.alloc_async(MIB))
        c.synchronize()
        kept = c.alloc_async(MIB)
        kept.write(b"async")
        assert kept.read(5) == b"async"
        c.alloc_async(1 << 50)
        try:
            c.synchronize()
        except Exception as error:
            assert "CUDA_ERROR_OUT_OF_MEMORY" in str(error)
        else:
            raise AssertionError("a failed alloc_async was not reported at synchronize")


def test_the_ctypes_driver_maps_a_large_legacy_buffer_and_names_cuda_errors(cuda_daemon: DaemonProcess) -> None:
    """A buffer above POOL_BUFFER_MAX is a legacy allocation: mapped with cuIpcOpenMemHandle through
    ctypes, its bytes seen; a forged handle fails with CUDA's own error name."""
    import dataclasses

    from cuctxd.client.data_plane.ipc_cuda import CudaMapping
    from cuctxd.protos.errors import CudaError
    from cuctxd.protos.limits import POOL_BUFFER_MAX

    with Client(cuda_daemon.endpoint) as owner, Client(cuda_daemon.endpoint) as other:
        buf = owner.alloc(POOL_BUFFER_MAX + 4096)
        buf.write(b"large and legacy", POOL_BUFFER_MAX)
        descriptor = owner.export(buf)
        assert descriptor.mechanism == "ipc"
        with other.open_shared(descriptor) as share:
            import torch

            mapped = torch.as_tensor(share, device="cuda")
            assert bytes(mapped[POOL_BUFFER_MAX:POOL_BUFFER_MAX + 16].cpu().numpy()) == b"large and legacy"
        forged = dataclasses.replace(descriptor, ipc_handle=bytes(64))
        try:
            CudaMapping(forged)
        except CudaError as error:
            assert error.name.startswith("CUDA_ERROR_"), error.name
        else:
            raise AssertionError("a forged IPC handle mapped")
