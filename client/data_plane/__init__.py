"""The data plane in this process: staging rings, transfers, host buffers, copy threads, pool imports, IPC, libcuda."""
