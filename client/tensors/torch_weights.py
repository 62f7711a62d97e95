"""PyTorch on top of :mod:`cuctxd.client.tensors.tensor_sets`: publish a state dict once, load it zero-copy anywhere.

``publish_state_dict(client, name, module_or_state_dict)`` puts every tensor in one
daemon buffer (device to device from the same GPU; bfloat16 travels as its bytes);
``load_state_dict(client, name)`` gives a :class:`LoadedState`, whose
``state_dict`` holds tensors that alias the daemon's memory (cuda backend: on the
GPU; sim: CPU tensors over the shared bytes). Keep the :class:`LoadedState` open
(``with``) while they are used: closing it unmaps them. torch has no read-only
tensors, so ``writable=False`` is a promise of the caller there, not enforced.
torch is imported only when these are called.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.api.sharing import byte_interface
from cuctxd.client.tensors.copies import Devices
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import CudaArray, TensorSet, open_tensors
from cuctxd.protos.layouts import DTYPES
from cuctxd.protos.records import ShareDescriptor


def _torch() -> Any:
    import torch

    return torch


def publish_state_dict(client: Client, name: str, module_or_state_dict: Any, metadata: Mapping[str, Any] | None = None,
                       *, device: Devices = None) -> ShareDescriptor:
    """Publish a module's (or a state dict's) tensors as ``name``; ``metadata`` goes with them; ``device``: several
    devices get a copy each (:func:`~cuctxd.client.tensors.publishing.publish_tensors`)."""
    return publish_tensors(client, name, publishable(module_or_state_dict), metadata, device=device)


def publishable(module_or_state_dict: Any) -> dict[str, Any]:
    """A module's (or a state dict's) tensors as :func:`publish_tensors` takes them: CUDA tensors as they are
    (copied device to device), host ones as numpy arrays, bfloat16 as its bytes named bfloat16."""
    torch = _torch()
    state = module_or_state_dict.state_dict() if hasattr(module_or_state_dict, "state_dict") else module_or_state_dict
    typestrs = {getattr(torch, name): (spec.typestr or ("<i2" if spec.itemsize == 2 else "|u1"), name)
                for name, spec in DTYPES.items() if hasattr(torch, name) and spec.itemsize in (1, 2, 4, 8)}
    tensors: dict[str, Any] = {}
    for key, tensor in state.items():
        if tensor.is_cuda and tensor.dtype in typestrs:
            # the interface made here from data_ptr(): torch's own costs tens of µs a tensor, and names no bf16;
            # no detach (a pointer needs none) and no copy of a contiguous tensor, as a trainer publishes each step
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            typestr, name = typestrs[tensor.dtype]
            interface = {"shape": tuple(tensor.shape), "typestr": typestr, "data": (tensor.data_ptr(), False),
                         "version": 3, "strides": None}
            tensors[key] = (CudaArray(interface, tensor), name)  # the tensor (or its contiguous copy) lives as long
            continue
        tensor = tensor.detach().contiguous()
        if (dtype := str(tensor.dtype).removeprefix("torch.")) in DTYPES and DTYPES[dtype].typestr is None:
            # no array interface names it (bfloat16, float8): its bytes as an integer of its size
            tensors[key] = (tensor.view(torch.int16 if DTYPES[dtype].itemsize == 2 else torch.uint8), dtype)
        elif tensor.is_cuda:
            tensors[key] = tensor
        else:
            tensors[key] = tensor.numpy()
    return tensors


def _host_base(share: Any, keep: object) -> Any:
    """A uint8 numpy array over the sim share's bytes. Without ``keep``, it exports the mapping (closing the share
    while a tensor over it lives is a ``BufferError``). With ``keep``, it holds no export: it is made at the
    mapping's address and holds ``keep``, whose finalizer closes the share once the array, and so the last
    tensor over it, is gone (a finalizer that ran while an export lived would fail to unmap)."""
    import numpy

    exported = numpy.frombuffer(share.host_view(), numpy.uint8, share.size)
    if keep is None:
        return exported
    address = exported.ctypes.data
    del exported  # no export of the mapping is left
    raw = (ctypes.c_uint8 * share.size).from_address(address)
    raw.keep = keep  # type: ignore[attr-defined]  # freed after the numpy array over it
    return numpy.ctypeslib.as_array(raw)


#: Views kept for a state's next refreshes: a version that lies in a buffer an earlier one of the name lay in, at
#: the same address with the same layout, gets the same views (the previous version's buffer and the spare).
RECENT_VIEWS = 2


class LoadedState:
    """The tensors published as one name, as torch tensors aliasing the daemon's memory: views of one
    uint8 tensor over the whole buffer (one ``torch.as_tensor``, then a slice and a view per tensor,
    which costs a fraction of an array-interface import each). ``version``: the name's version it is."""

    def __init__(self, tensors: TensorSet, keep: object = None,
                 recent: list[tuple[tuple[int, int, bytes], dict[str, Any]]] | None = None) -> None:
        """``keep``: an object the tensors keep alive, freed once the last of them is (see :func:`load_state_dict`).
        ``recent``: the views earlier states of the name made (:meth:`refresh`), reused where this version lies
        at the same address with the same layout (cuda: a buffer this process kept mapped, which versions reuse;
        the views are pointers and shapes, valid for whatever that mapping holds now)."""
        self.tensors = tensors
        self.metadata = tensors.metadata
        self.version = tensors.version
        self._recent = [] if recent is None else recent
        share = tensors.share
        key = (share.ptr, share.size, share.descriptor.manifest) if share.backend == "cuda" and keep is None else None
        found = next((views for known, views in self._recent if known == key), None) if key else None
        self.state_dict: dict[str, Any] = dict(found) if found is not None else self._views(keep)
        if key is not None and found is None:
            self._recent[:] = [(key, dict(self.state_dict)), *self._recent][:RECENT_VIEWS]

    def _views(self, keep: object) -> dict[str, Any]:
        """One torch tensor per tensor of the layout, views of one tensor over the whole buffer."""
        torch = _torch()
        share = self.tensors.share
        if share.backend == "cuda":
            # torch refuses read-only CUDA arrays: its tensors are writable whatever was asked
            array = CudaArray(byte_interface(share.ptr, share.size, False))
            array.keep = keep  # type: ignore[attr-defined]  # torch holds the array until the last tensor over it is freed
            base = torch.as_tensor(array, device="cuda")
        else:
            base = torch.from_numpy(_host_base(share, keep))  # torch holds the array until its last tensor goes
        state_dict: dict[str, Any] = {}
        whole: dict[str, Any] = {}  # the buffer viewed as each dtype: one as_strided a tensor then
        for key, shared in self.tensors.items():
            spec = shared.spec
            itemsize = DTYPES[spec.dtype].itemsize
            if share.size % itemsize == 0 and spec.offset % itemsize == 0:
                typed = whole.get(spec.dtype)
                if typed is None:
                    typed = whole[spec.dtype] = base.view(getattr(torch, spec.dtype))
                state_dict[key] = typed.as_strided(spec.shape, spec.strides, spec.offset // itemsize)
            else:
                typed = base[spec.offset:spec.extent()].view(getattr(torch, spec.dtype))
                state_dict[key] = typed.as_strided(spec.shape, spec.strides)
        return state_dict

    def refresh(self) -> LoadedState | None:
        """The state of the name's newest version, or None if there is none newer; close this one once no module
        uses its tensors any more (after :func:`swap_parameters`, say)."""
        newer = self.tensors.refresh()
        return None if newer is None else self.successor(newer)

    def successor(self, newer: TensorSet) -> LoadedState:
        """The state of ``newer``, a later version of the same name (:meth:`TensorSet.refresh`): its views are the
        ones an earlier state of this chain made where it lies at the same address with the same layout."""
        return LoadedState(newer, recent=self._recent)

    def copy_into(self, module: Any) -> int:
        """Copy every tensor into ``module``'s own parameters and buffers of the same names (or into a mapping of
        name to torch tensor), device to device (torch ``copy_``; for engines that keep their own parameters);
        returns the bytes copied."""
        torch = _torch()
        targets = module if isinstance(module, Mapping) else _named_tensors(module)
        missing = [key for key in self.state_dict if key not in targets]
        if missing:
            raise KeyError(f"the module has no parameter or buffer {missing[0]!r} ({len(missing)} missing)")
        copied = 0
        with torch.no_grad():
            for key, tensor in self.state_dict.items():
                targets[key].copy_(tensor, non_blocking=True)
                copied += tensor.numel() * tensor.element_size()
        if self.tensors.backend == "cuda":
            torch.cuda.synchronize()
        return copied

    def close(self) -> None:
        """Unmap: the tensors in ``state_dict`` must not be used afterwards."""
        self.state_dict.clear()
        self.tensors.close()

    def __enter__(self) -> LoadedState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_state_dict(client: Client, name: str, *, writable: bool = False, device: int | None = None,
                    keep: object = None) -> LoadedState:
    """Map the state dict published as ``name``: its copy on ``device``, by default on this process's current GPU
    (:func:`~cuctxd.client.tensors.tensor_sets.open_tensors`); ``module.load_state_dict(loaded.state_dict,
    assign=True)`` makes a module use the shared memory itself. ``keep``: an object that lives exactly as long as
    the last tensor over the mapping; its finalizer may close the tensors then (no tensor is left to use them,
    and on the sim no export of the mapping is held)."""
    return LoadedState(open_tensors(client, name, writable=writable, device=device), keep)


def _named_tensors(module: Any) -> dict[str, Any]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def swap_parameters(module: Any, loaded: LoadedState) -> None:
    """Make ``module``'s parameters and buffers the tensors of ``loaded`` (zero-copy, in place of
    ``load_state_dict(assign=True)``): each keeps its identity (``param.data`` is swapped), so optimizers,
    hooks and references to it stay valid. Every tensor of ``loaded`` needs one of its name, shape and dtype
    (:class:`KeyError`, :class:`ValueError` otherwise, before anything is swapped). The module then uses
    ``loaded``'s memory: keep ``loaded`` open until the next swap."""
    targets = _named_tensors(module)
    for key, tensor in loaded.state_dict.items():
        target = targets.get(key)
        if target is None:
            raise KeyError(f"the module has no parameter or buffer {key!r}")
        if target.shape != tensor.shape or target.dtype != tensor.dtype:
            raise ValueError(f"{key!r}: the module has {target.dtype}{list(target.shape)}, the layout "
                             f"{tensor.dtype}{list(tensor.shape)}")
    for key, tensor in loaded.state_dict.items():
        targets[key].data = tensor
