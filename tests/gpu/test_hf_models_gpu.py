"""cuctxd.client.hf_models.from_pretrained on a real GPU: CUDA parameters that are views of the daemon's layout,
logits identical to transformers' own from_pretrained on the same device, and the mapping gone with the model."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from cuctxd import Client
from tests.helpers import DaemonProcess

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_models = pytest.importorskip("cuctxd.client.hf_models")

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 256}


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17]], device="cuda:0")).logits


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
                                    transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)],
                         ids=["llama", "qwen2 tied"])
def test_cuda_parameters_and_the_same_logits(config: Any, cuda_daemon: DaemonProcess, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    expected = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).to(
        "cuda:0").eval())
    name = f"gpu-{type(config).__name__}"
    with Client(cuda_daemon.endpoint) as observer:
        model = hf_models.from_pretrained(str(tmp_path), name=name, device=0, client=observer)
        assert all(param.is_cuda for param in model.parameters())
        assert len({param.untyped_storage().data_ptr() for param in model.parameters()}) == 1
        assert torch.equal(logits(model), expected)

        def holders() -> list[int]:
            device = observer.status()["devices"][0]
            return [h for share in device["shares"] if name in share["names"] for h in share["holders"]]

        assert holders() == [observer.session_id]
        del model
        gc.collect()
        assert holders() == []  # unmapped and let go with the model
        observer.unpublish(name)
