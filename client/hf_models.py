"""Hugging Face transformers on cuctxd: ``from_pretrained`` whose parameters are zero-copy views of a published layout.

``cuctxd.client.hf_models.from_pretrained(path)`` is the drop-in for ``AutoModelForCausalLM.from_pretrained(path)``
on a local directory written by ``save_pretrained``. It publishes the checkpoint's safetensors as one layout (as
``cuctx load`` does; the same content already published is attached to, other content under the name is refused
with :class:`~cuctxd.protos.errors.NameExists`), builds the model from its config with every parameter on the
``meta`` device and every buffer computed as transformers computes it (on the CPU, then moved to the model's
device: the buffers of ``__init__``, non-persistent ones like ``rotary_emb.inv_freq`` included, bit for bit),
assigns the mapped tensors as its parameters, and ties the weights transformers ties (a tied ``lm_head`` is absent
from the checkpoint). The model owns the mapping: the daemon's hold and the mapping end when the model and the last
of its tensors are gone, not before (no ``BufferError``), and not after (no leak).

Why not ``cuctxd.transformers``: the repository's root is the ``cuctxd`` package and is on ``sys.path`` in the
tests, so a root module named ``transformers.py`` would shadow the real ``transformers`` package there (as a root
``ray.py`` shadowed Ray); this module is in ``client/`` beside ``ray_nodes``. Needs the ``transformers`` extra
(``pip install 'cuctxd[transformers]'``). Which thread may call: any; the model's tensors follow torch's rules.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

from cuctxd.client.api.client import Client
from cuctxd.client.tensors.safetensors_load import load_safetensors
from cuctxd.client.tensors.tensor_sets import TensorSet
from cuctxd.client.tensors.torch_weights import load_state_dict
from cuctxd.protos.errors import BadArgument

#: Prefix of the name a checkpoint is published under when ``name`` is not given.
NAME_PREFIX = "hf/"


def default_name(path: str) -> str:
    """The name ``from_pretrained`` publishes ``path`` under by default: ``hf/<folder>-<12 hex digits of the
    sha256 of its real path>``. Workers naming the same folder meet on one name; two folders of the same base
    name do not collide; the same content under two folders is two names (give ``name=`` to share it)."""
    real = os.path.realpath(path)
    folder = os.path.basename(real.rstrip("/")) or "model"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in folder)[:64]
    return f"{NAME_PREFIX}{safe}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


class PrivateCopyWarning(UserWarning):
    """A parameter was converted to another dtype: it is this process's own copy, not the shared memory."""


def from_pretrained(pretrained_model_name_or_path: str, *, name: str | None = None, device: int | None = None,
                    client: Client | None = None, auto_class: Any = None, **kwargs: Any) -> Any:
    """A ``transformers.PreTrainedModel`` in eval mode over the checkpoint in the local directory
    ``pretrained_model_name_or_path``, its parameters views of the layout published as ``name`` (default:
    :func:`default_name`), published first if it is not. ``device``: the GPU whose copy is used (default: the
    daemon's choice, the current device); on the sim the tensors are CPU tensors over the shared memory.
    ``client``: a client of the caller's to open the layout with (its session holds the layout until the model's
    last tensor is gone); default: a ``Client()`` of the model's own, closed then.
    ``auto_class``: the transformers auto class (default ``AutoModelForCausalLM``). ``torch_dtype`` (or ``dtype``):
    the checkpoint's dtype unless said; a tensor converted to another dtype is a private copy
    (:class:`PrivateCopyWarning` says how many bytes). ``attn_implementation`` goes to the model; other keyword
    arguments to its config. Raises :class:`BadArgument` for a path that is no such directory or a checkpoint
    that does not fill the model, :class:`NameExists` where other content holds ``name``."""
    import torch
    import transformers

    path = pretrained_model_name_or_path
    if not os.path.isdir(path):
        raise BadArgument(f"{path}: not a directory: from_pretrained reads a local directory written by "
                          "save_pretrained (download it first, e.g. with huggingface_hub.snapshot_download)")
    name = name or default_name(path)
    said = kwargs.pop("torch_dtype", None), kwargs.pop("dtype", None)
    dtype = said[0] or said[1]
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    model_kwargs = {key: kwargs.pop(key) for key in ("attn_implementation",) if key in kwargs}
    config = transformers.AutoConfig.from_pretrained(path, **kwargs)
    own_client = client is None
    session = Client() if client is None else client
    try:
        with _one_load_at_a_time(name):
            load_safetensors(session, path, name, device=device)
        holder = _Holder(session if own_client else None)
        loaded = load_state_dict(session, name, device=device, keep=holder)
        holder.tensors = loaded.tensors
    except BaseException:
        if own_client:
            session.close()
        raise
    state = loaded.state_dict
    if dtype in (None, "auto"):
        dtype = _checkpoint_dtype(state) or torch.float32
    target = next(iter(state.values())).device if state else torch.device("cpu")
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # 5 renamed it
    with torch.device("cpu"), _parameters_on_meta():  # buffers computed where transformers computes them
        model = (auto_class or transformers.AutoModelForCausalLM).from_config(config, **{dtype_key: dtype},
                                                                              **model_kwargs)
    for module in model.modules():  # then moved to the model's device, as its from_pretrained does
        for key, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[key] = buffer.to(target)
    _assign(model, state, dtype)
    model._cuctxd_layout = loaded  # the model keeps the mapping: it goes with the model and its last tensor
    return model.eval()


@contextlib.contextmanager
def _one_load_at_a_time(name: str) -> Iterator[None]:
    """Workers of this host starting together: the first loads the checkpoint, the others wait for it here, then
    find the name holding the same content and attach (instead of each loading a copy, all but one refused)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    lock_path = os.path.join(tempfile.gettempdir(), f"cuctxd-{os.getuid()}-load-{digest}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _Holder:
    """What the model's tensors keep alive: its finalizer, run once the last tensor over the mapping is gone,
    unmaps it and drops the daemon's hold (``tensors``), then closes the model's own client (``client``; None
    where the caller gave one). Which thread runs it: whichever frees the last tensor."""

    def __init__(self, client: Client | None) -> None:
        self.client = client
        self.tensors: TensorSet | None = None

    def __del__(self) -> None:
        try:
            if self.tensors is not None:
                self.tensors.close()
        finally:
            if self.client is not None:
                self.client.close()


def _checkpoint_dtype(state: dict[str, Any]) -> Any:
    """The floating dtype most of the checkpoint's bytes have (None for none)."""
    counts: Counter[Any] = Counter()
    for tensor in state.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel() * tensor.element_size()
    return counts.most_common(1)[0][0] if counts else None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While the model is built: each parameter goes to ``meta`` as it is registered (after its module made it on
    the CPU, one at a time, before it is initialized), while buffers stay where they were made (as accelerate's
    ``init_empty_weights(include_buffers=False)``)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: Any, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _assign(model: Any, state: dict[str, Any], dtype: Any) -> None:
    """The mapped tensors as ``model``'s parameters and persistent buffers; tied weights tied; anything left on
    ``meta`` or in the checkpoint but not the model is a :class:`BadArgument`."""
    converted = 0
    tensors: dict[str, Any] = {}
    for key, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
            converted += tensor.numel() * tensor.element_size()
        tensors[key] = tensor
    if converted:
        warnings.warn(f"converted to {dtype}: {converted} bytes of parameters are this process's own copy, not "
                      "the shared layout (publish the checkpoint in that dtype to share them)", PrivateCopyWarning,
                      stacklevel=3)
    expected = set(model.state_dict())
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise BadArgument(f"the checkpoint has {len(unexpected)} tensors the model has not: {unexpected[:5]}")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    left = [key for key, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]
    if left:
        raise BadArgument(f"the checkpoint lacks {len(left)} of the model's tensors: {left[:5]}")
    for param in model.parameters():
        param.requires_grad_(False)


__all__ = ["NAME_PREFIX", "PrivateCopyWarning", "default_name", "from_pretrained"]
