"""A generated, real-shaped bf16 checkpoint, and the page cache around it, for figure 9's loaders.

:func:`write_checkpoint` writes a Llama-shaped model (:class:`ModelShape`) of random bytes through a
small safetensors writer of our own: numpy has no bfloat16, so ``safetensors.numpy`` could only label
the tensors U16. :func:`evict` makes the file cold (``fsync``, then ``POSIX_FADV_DONTNEED``),
:func:`read_through` warm, and :func:`resident_fraction` says which it is (``mincore``), since eviction
is only advice: a tmpfs, for one, keeps every page. All of it runs on the bench's main thread.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: ``layers`` blocks of attention (grouped-query: ``kv`` rows in k and v)
    and a gated MLP, with a 1-D norm before each, between a ``vocab`` x ``hidden`` embedding and lm_head."""

    layers: int
    hidden: int
    intermediate: int
    kv: int
    vocab: int

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Shapes by Hugging Face Llama names, in file order."""
        h, i = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for layer in range(self.layers):
            block = f"model.layers.{layer}."
            shapes.update({
                block + "input_layernorm.weight": (h,),
                block + "self_attn.q_proj.weight": (h, h),
                block + "self_attn.k_proj.weight": (self.kv, h),
                block + "self_attn.v_proj.weight": (self.kv, h),
                block + "self_attn.o_proj.weight": (h, h),
                block + "post_attention_layernorm.weight": (h,),
                block + "mlp.gate_proj.weight": (i, h),
                block + "mlp.up_proj.weight": (i, h),
                block + "mlp.down_proj.weight": (h, i),
            })
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab, h)
        return shapes

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(shape) for shape in self.tensors().values())


#: 255 tensors, 2.79 GB, the largest (embedding and lm_head) 131 MB: the size class of issue 28's checkpoint.
FULL_MODEL = ModelShape(layers=28, hidden=2048, intermediate=5632, kv=512, vocab=32000)
#: The same 255 tensors, narrower: 48 MB, for ``--quick`` and the sim's devices.
QUICK_MODEL = ModelShape(layers=28, hidden=256, intermediate=704, kv=64, vocab=8000)


def write_checkpoint(path: str, shape: ModelShape, seed: int = 0) -> int:
    """Write ``shape`` as a ``.safetensors`` file of BF16 tensors filled with random bytes, synced to disk
    (so that :func:`evict` can drop every page); returns the file's size."""
    import numpy

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shape.tensors().items():
        size = 2 * math.prod(dims)
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    words = numpy.random.default_rng(seed).bit_generator  # random_raw: raw 64-bit words, the fastest source
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)))
        file.write(raw)
        for dims in shape.tensors().values():
            size = 2 * math.prod(dims)
            file.write(words.random_raw(-(-size // 8)).view(numpy.uint8)[:size])
        file.flush()
        os.fsync(file.fileno())
    return 8 + len(raw) + offset


def read_through(path: str) -> None:
    """Read the whole file once, so that it is in the page cache."""
    chunk = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as file:
        while file.readinto(chunk):
            pass


def evict(path: str) -> None:
    """Ask the kernel to drop the file's pages (written back first: dirty pages would stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str) -> float:
    """The share of the file's pages in the page cache (``mincore`` of a shared read-only mapping, which
    reads nothing itself); OSError where the calls fail."""
    import numpy

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path}: {os.strerror(ctypes.get_errno())}")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return int((numpy.frombuffer(vector, numpy.uint8) & 1).sum()) / pages
