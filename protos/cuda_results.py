"""CUDA driver result codes, by CUDA's own names and values.

The sim backend raises these so that a client cannot tell a simulated failure
from a real one; the cuda backend reads names and messages from the driver
itself and the contract suite checks that this table agrees with it.
"""

from enum import IntEnum


class CUresult(IntEnum):
    """The subset of ``CUresult`` (cuda.h) that cuctxd can produce or forward."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_MAP_FAILED = 205
    CUDA_ERROR_ALREADY_MAPPED = 208
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


#: Codes after which a CUDA context is corrupt: every later call in it fails the same way
#: (ECC uncorrectable, illegal address, device assert, hardware stack error, illegal
#: instruction, misaligned address, invalid address space, invalid PC, launch failure).
STICKY_CODES = frozenset({214, 700, 710, 714, 715, 716, 717, 718, 719})

#: What ``cuGetErrorString`` returns for each code (driver 580).
DRIVER_MESSAGES: dict[CUresult, str] = {
    CUresult.CUDA_SUCCESS: "no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: "invalid argument",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: "out of memory",
    CUresult.CUDA_ERROR_NOT_INITIALIZED: "initialization error",
    CUresult.CUDA_ERROR_DEINITIALIZED: "driver shutting down",
    CUresult.CUDA_ERROR_NO_DEVICE: "no CUDA-capable device is detected",
    CUresult.CUDA_ERROR_INVALID_DEVICE: "invalid device ordinal",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: "invalid device context",
    CUresult.CUDA_ERROR_MAP_FAILED: "mapping of buffer object failed",
    CUresult.CUDA_ERROR_ALREADY_MAPPED: "resource already mapped",
    CUresult.CUDA_ERROR_CONTEXT_ALREADY_IN_USE: "exclusive-thread device already in use by a different thread",
    CUresult.CUDA_ERROR_INVALID_HANDLE: "invalid resource handle",
    CUresult.CUDA_ERROR_NOT_FOUND: "named symbol not found",
    CUresult.CUDA_ERROR_NOT_READY: "device not ready",
    CUresult.CUDA_ERROR_ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: "peer access is already enabled",
    CUresult.CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: "peer access has not been enabled",
    CUresult.CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: "cannot set while device is active in this process",
    CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
    CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED: "context is destroyed",
    CUresult.CUDA_ERROR_LAUNCH_FAILED: "unspecified launch failure",
    CUresult.CUDA_ERROR_NOT_PERMITTED: "operation not permitted",
    CUresult.CUDA_ERROR_NOT_SUPPORTED: "operation not supported",
    CUresult.CUDA_ERROR_UNKNOWN: "unknown error",
}
