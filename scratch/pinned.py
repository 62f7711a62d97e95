"""Is memmove into pinned staging + pinned HtoD faster than pageable HtoD? (4 MiB and 64 MiB)"""
import ctypes, time
from cuda.bindings import driver as cu
def ck(r):
    assert r[0] == cu.CUresult.CUDA_SUCCESS, r[0]
    return r[1] if len(r) == 2 else None
ck(cu.cuInit(0)); dev = ck(cu.cuDeviceGet(0)); ctx = ck(cu.cuDevicePrimaryCtxRetain(dev)); ck(cu.cuCtxSetCurrent(ctx))
for size in (4 << 20, 64 << 20):
    d = ck(cu.cuMemAlloc(size))
    src = bytearray(b"\x01") * size
    pinned = ck(cu.cuMemHostAlloc(size, cu.CU_MEMHOSTALLOC_PORTABLE))
    pv = (ctypes.c_char * size).from_address(int(pinned))
    reps = max(5, (256 << 20) // size)
    def t(f):
        f(); t0 = time.perf_counter()
        for _ in range(reps): f()
        return size * reps / (time.perf_counter() - t0) / 1e9
    pageable = t(lambda: ck(cu.cuMemcpyHtoD(d, src, size)))
    memmove = t(lambda: ctypes.memmove(pv, (ctypes.c_char * size).from_buffer(src), size))
    staged = t(lambda: (ctypes.memmove(pv, (ctypes.c_char * size).from_buffer(src), size), ck(cu.cuMemcpyHtoD(d, int(pinned), size))))
    pinned_only = t(lambda: ck(cu.cuMemcpyHtoD(d, int(pinned), size)))
    print(f"{size>>20} MiB GB/s: pageable HtoD {pageable:.2f}  memmove {memmove:.2f}  memmove+pinned HtoD {staged:.2f}  pinned HtoD {pinned_only:.2f}")
    ck(cu.cuMemFreeHost(pinned)); ck(cu.cuMemFree(d))
