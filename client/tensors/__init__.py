"""Tensors and framework adapters: tensor sets by name, DLPack, torch state dicts, CuPy arrays, safetensors files."""

from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
from cuctxd.client.tensors.versions import publish_version, wait_version

__all__ = ["open_tensors", "publish_tensors", "publish_version", "wait_version"]
