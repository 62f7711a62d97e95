"""Probe (issue 25, item 4): can a process that imported a CUDA pool reach an allocation of that pool that
was never exported to it, by forging or altering the 64 bytes of ``CUmemPoolPtrExportData``?

This process makes an IPC-capable pool with the daemon's own cuda backend, allocates two buffers in it,
writes a secret into the second and exports only the first (pool fd and pointer data) to a child process.
The child imports the pool and the first buffer (which must work: the probe's sanity check), then tries
altered copies of the first buffer's export data (each 8- and 4-byte little-endian field moved by the
distance between the two buffers, or set to the second's address where it held the first's) and reads
whatever imports. The finding is printed (run with ``-s``) as ``PROBE: ...``; the daemon assumes the
worst either way (every exported buffer has a pool of its own, daemon/device/pools.py), so a forgery that
works is reported, not failed. Skipped without a GPU (``conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO, client_env

SIZE = 1 << 20
SECRET = b"never-exported!!" * 4

CHILD = r"""
import ctypes, struct, sys
from cuctxd.client.data_plane.cuda_driver import driver

fd, uuid, export_hex, first, second, size, secret_hex = sys.argv[1:]
fd, first, second, size = int(fd), int(first), int(second), int(size)
export, secret = bytes.fromhex(export_hex), bytes.fromhex(secret_hex)
cu = driver("probe")
device = cu.find_device(uuid)
context = cu.retain_primary(device)

def read(ptr, n):
    out = ctypes.create_string_buffer(n)
    cu.call("cuMemcpyDtoH_v2", ctypes.c_void_p(ctypes.addressof(out)), ctypes.c_uint64(ptr), ctypes.c_size_t(n))
    return out.raw

def candidates():
    delta = second - first
    for width, fmt in ((8, "<Q"), (4, "<I")):
        for at in range(0, 64, width):
            (value,) = struct.unpack_from(fmt, export, at)
            options = {value + delta, value - delta}
            if value == first % (1 << (8 * width)):
                options.add(second % (1 << (8 * width)))
            for option in options:
                if 0 <= option < 1 << (8 * width):
                    forged = bytearray(export)
                    struct.pack_into(fmt, forged, at, option)
                    if bytes(forged) != export:
                        yield at, width, bytes(forged)

with cu.current(context):
    pool = cu.pool_import(fd)
    mine = cu.pool_import_pointer(pool, export)
    print("SANITY", read(mine, 16) == b"exported buffer!", flush=True)
    tried = reached = 0
    for at, width, forged in candidates():
        tried += 1
        print(f"TRYING field at byte {at} ({width} bytes)", flush=True)
        try:
            ptr = cu.pool_import_pointer(pool, forged)
        except Exception as refused:
            continue
        try:
            data = read(ptr, len(secret))
        except Exception:
            data = b""
        if data == secret:
            reached += 1
            print(f"REACHED by field at byte {at} ({width} bytes)", flush=True)
    print(f"TRIED {tried} REACHED {reached}", flush=True)
"""


def test_an_importer_of_a_pool_forging_export_data_for_an_allocation_never_exported() -> None:
    from cuctxd.daemon.backends.cuda import CudaDriver

    cuda = CudaDriver()
    cuda.init()
    context = cuda.primary_ctx_retain(0)
    cuda.ctx_push(context)
    pool = cuda.mem_pool_create(0, ipc=True)
    try:
        first = cuda.mem_alloc_from_pool(SIZE, pool, None)
        second = cuda.mem_alloc_from_pool(SIZE, pool, None)
        cuda.memcpy_htod(first, memoryview(b"exported buffer!"), 16)
        cuda.memcpy_htod(second, memoryview(SECRET), len(SECRET))
        cuda.ctx_synchronize()
        export = cuda.mem_pool_export_pointer(first)
        fd = cuda.mem_pool_export_fd(pool)
        try:
            args = [str(fd), cuda.device_info(0).uuid, export.hex(), str(first), str(second), str(SIZE),
                    SECRET.hex()]
            done = subprocess.run([sys.executable, "-c", CHILD, *args], pass_fds=[fd], capture_output=True,
                                  text=True, env=client_env(), cwd=REPO, timeout=120)
        finally:
            os.close(fd)
        lines = done.stdout.splitlines()
        assert "SANITY True" in lines, (done.returncode, done.stdout, done.stderr)  # the legitimate import works
        reached = [line for line in lines if line.startswith(("REACHED", "TRIED"))]
        if done.returncode != 0:  # the importer died on forged data: what it tried last is the finding
            tried = [line for line in lines if line.startswith("TRYING")]
            reached.append(f"the importer died (status {done.returncode}) at: {tried[-1] if tried else '?'}; "
                           f"stderr {done.stderr.strip()[-300:]!r}")
        print(f"PROBE: export data {export.hex()}, first {first:#x}, second {second:#x}: " + "; ".join(reached))
    finally:
        cuda.mem_free_async(first, None)
        cuda.mem_free_async(second, None)
        cuda.ctx_synchronize()
        cuda.mem_pool_destroy(pool)
        cuda.ctx_pop()
        cuda.primary_ctx_release(0)
