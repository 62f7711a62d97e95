"""cuctxd.client.hf_models.from_pretrained against transformers' own, on small random models written with
save_pretrained: the same logits, parameters that are views of one shared mapping, the name attached to or
refused, a dtype conversion said, and the mapping gone with the model (sim backend: CPU tensors)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cuctxd import Client, NameExists
from tests.helpers import DaemonProcess

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_models = pytest.importorskip("cuctxd.client.hf_models")


@pytest.fixture(scope="module")
def daemon_args() -> tuple[str, ...]:
    return ("--sim-devices", "1", "--sim-memory", "64MiB")


@pytest.fixture
def endpoint(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The daemon as the default endpoint: from_pretrained's own ``Client()`` reaches it."""
    monkeypatch.setenv("CUCTXD_ENDPOINT", daemon.endpoint)
    yield daemon.endpoint


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}


def save_model(folder: Path, config: Any, dtype: Any, shard: str | None = None) -> Path:
    """A random-weight model of ``config`` in ``dtype`` written with save_pretrained (``shard``: max_shard_size)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def logits(model: Any) -> Any:
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17]])
    with torch.no_grad():
        return model(ids).logits


def shared_storages(model: Any) -> set[int]:
    return {param.untyped_storage().data_ptr() for param in model.parameters()}


CASES = {
    "llama, one file, float32": (lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
                                 "float32", None),
    "qwen2, shards and an index, tied, bfloat16": (lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
                                                   "bfloat16", "40KB"),
    "gpt2, one file, tied, float32": (lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                                                       n_positions=128), "float32", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_are_those_of_transformers_from_pretrained(case: str, endpoint: str, tmp_path: Path) -> None:
    make_config, dtype_name, shard = CASES[case]
    dtype = getattr(torch, dtype_name)
    folder = save_model(tmp_path / "model", make_config(), dtype, shard)
    if shard:
        assert (folder / "model.safetensors.index.json").exists()
    expected = logits(transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval())
    model = hf_models.from_pretrained(str(folder), torch_dtype=dtype)
    assert isinstance(model, transformers.PreTrainedModel) and not model.training
    assert torch.equal(logits(model), expected)
    assert len(shared_storages(model)) == 1  # every parameter a view of the one mapping
    assert all(param.device.type == "cpu" for param in model.parameters())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_checkpoints_dtype_is_taken_and_a_second_worker_attaches(endpoint: str, tmp_path: Path) -> None:
    folder = save_model(tmp_path / "model", transformers.LlamaConfig(**SMALL), torch.bfloat16)
    first = hf_models.from_pretrained(str(folder))
    second = hf_models.from_pretrained(str(folder))
    assert first.dtype == torch.bfloat16
    assert torch.equal(logits(first), logits(second))
    with Client(endpoint) as observer:
        names = [share["name"] for share in observer.list_shared(prefix=hf_models.NAME_PREFIX)]
    assert names.count(hf_models.default_name(str(folder))) == 1


def test_other_content_under_the_name_is_refused(endpoint: str, tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**SMALL)
    first = save_model(tmp_path / "first", config, torch.float32)
    torch.manual_seed(1)
    other = tmp_path / "other"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(other)
    hf_models.from_pretrained(str(first), name="refused-test")
    with pytest.raises(NameExists):
        hf_models.from_pretrained(str(other), name="refused-test")


def test_a_conversion_is_a_private_copy_and_says_so(endpoint: str, tmp_path: Path) -> None:
    folder = save_model(tmp_path / "model", transformers.LlamaConfig(**SMALL), torch.bfloat16)
    expected = logits(transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval())
    with pytest.warns(hf_models.PrivateCopyWarning, match="own copy"):
        model = hf_models.from_pretrained(str(folder), torch_dtype=torch.float32)
    assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("own_client", [True, False], ids=["its own client", "the caller's client"])
def test_the_mapping_lives_as_long_as_the_model(own_client: bool, endpoint: str, tmp_path: Path) -> None:
    folder = save_model(tmp_path / "model", transformers.LlamaConfig(**SMALL), torch.float32)
    name = f"lifetime-test-{own_client}"
    with Client(endpoint) as observer:
        def holders() -> list[int]:
            shares = observer.status()["devices"][0]["shares"]
            return [h for share in shares if name in share["names"] for h in share["holders"]]

        model = hf_models.from_pretrained(str(folder), name=name, client=None if own_client else observer)
        weight = model.lm_head.weight
        assert len(holders()) == 1
        del model
        gc.collect()
        assert len(holders()) == 1  # a tensor of it is still in use: the mapping stays
        assert torch.isfinite(weight).all()
        del weight
        gc.collect()
        assert holders() == []  # no BufferError on the way, and no hold left behind
        observer.unpublish(name)


def test_fp8_checkpoints_map_as_torch_float8(endpoint: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from cuctxd import load_state_dict
    from cuctxd.client.tensors.safetensors_load import load_safetensors

    torch.manual_seed(0)
    written = {"e4m3": torch.randn(4, 16).to(torch.float8_e4m3fn), "e5m2": torch.randn(8).to(torch.float8_e5m2),
               "scale": torch.ones(1, dtype=torch.float32)}
    save_file(written, tmp_path / "fp8.safetensors")
    expected = load_file(tmp_path / "fp8.safetensors")
    with Client(endpoint) as c:
        load_safetensors(c, str(tmp_path / "fp8.safetensors"), "fp8-test")
        with load_state_dict(c, "fp8-test") as loaded:
            for key, tensor in expected.items():
                mapped = loaded.state_dict[key]
                assert mapped.dtype == tensor.dtype
                assert torch.equal(mapped.view(torch.uint8), tensor.view(torch.uint8)), key
            del mapped
        c.unpublish("fp8-test")


def test_one_file_and_its_shards_are_the_same_content(endpoint: str, tmp_path: Path) -> None:
    from cuctxd.client.tensors.safetensors_load import load_safetensors

    config = transformers.LlamaConfig(**SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    with Client(endpoint) as c:
        assert load_safetensors(c, str(tmp_path / "one"), "same-content-test").loaded
        again = load_safetensors(c, str(tmp_path / "shards"), "same-content-test")
        assert not again.loaded  # attached: the same tensors, in another order
        c.unpublish("same-content-test")
