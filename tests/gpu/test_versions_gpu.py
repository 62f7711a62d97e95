"""Versioned names on a real GPU: a trainer process publishes versions of its CUDA (bf16) parameters device to
device; an engine holding version 1 computes with it while versions 2 and 3 come, swaps its module's parameters
to the newest zero-copy, and another copies each version into parameters of its own."""

from __future__ import annotations

from tests.helpers import DaemonProcess, run_client, spawn_client, wait_for_line

TRAINER = """
import torch
from cuctxd import Client
from cuctxd.client.tensors import publish_version, wait_version
model = torch.nn.Linear(4, 4, device="cuda", dtype=torch.bfloat16)
with Client(ENDPOINT) as c:
    for version in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(version)
            model.bias.fill_(version)
        print("published", publish_version(c, "gpu-policy", model), flush=True)
        if version == 1:
            wait_version(c, "gpu-ack", 0, timeout=120)  # the engine holds version 1
"""

ENGINE = """
import numpy, torch
from cuctxd import Client
from cuctxd.client.tensors import publish_version, wait_version
from cuctxd.client.tensors.torch_weights import load_state_dict, swap_parameters
module = torch.nn.Linear(4, 4, device="cuda", dtype=torch.bfloat16)
own = torch.nn.Linear(4, 4, device="cuda", dtype=torch.bfloat16)
x = torch.ones(1, 4, device="cuda", dtype=torch.bfloat16)
with Client(ENDPOINT) as c:
    wait_version(c, "gpu-policy", 0, timeout=120)
    held = load_state_dict(c, "gpu-policy")
    weight = module.weight
    swap_parameters(module, held)
    print("holding", held.version, module(x)[0, 0].item(), module.weight is weight,
          module.weight.data_ptr() == held.state_dict["weight"].data_ptr(), flush=True)
    publish_version(c, "gpu-ack", {"held": numpy.ones(1)})
    wait_version(c, "gpu-policy", 2, timeout=120)
    print("still", module(x)[0, 0].item(), flush=True)  # version 1, held, unchanged by 2 and 3
    newer = held.refresh()
    swap_parameters(module, newer)
    held.close()
    newer.copy_into(own)
    print("swapped", newer.version, module(x)[0, 0].item(), own(x)[0, 0].item(), flush=True)
    newer.close()
    print("copy kept", own(x)[0, 0].item(), flush=True)
    c.unpublish("gpu-ack")
"""


def test_an_engine_computes_with_its_version_then_swaps_and_copies_the_newest(cuda_daemon: DaemonProcess) -> None:
    with spawn_client(ENGINE, cuda_daemon.endpoint) as engine, \
            spawn_client(TRAINER, cuda_daemon.endpoint) as trainer:
        assert wait_for_line(trainer, "published", 300).split() == ["published", "1"]
        holding = wait_for_line(engine, "holding", 300).split()
        assert holding == ["holding", "1", "5.0", "True", "True"]  # 4 inputs * weight 1 + bias 1
        assert wait_for_line(trainer, "published 3", 300).split() == ["published", "3"]  # after "published 2"
        assert wait_for_line(engine, "still", 300).split() == ["still", "5.0"]
        assert wait_for_line(engine, "swapped", 300).split() == ["swapped", "3", "15.0", "15.0"]
        assert wait_for_line(engine, "copy kept", 300).split()[-1] == "15.0"
        assert engine.wait(120) == 0 and trainer.wait(120) == 0
    out = run_client("""
from cuctxd import Client
with Client(ENDPOINT) as c:
    print("current", c.lookup("gpu-policy").version, c.lookup("gpu-policy").mechanism)
    c.unpublish("gpu-policy")
""", cuda_daemon.endpoint)
    assert "current 3 " in out, out


def test_a_version_copied_device_to_device_gets_the_digest_its_bytes_have_from_the_daemon(
        cuda_daemon: DaemonProcess) -> None:
    out = run_client("""
import torch
from cuctxd import Client
from cuctxd.client.tensors import open_tensors, publish_version
from cuctxd.protos import digests
torch.manual_seed(0)
state = {f"layer{i}": torch.randn(1 << 20, dtype=torch.bfloat16, device="cuda") for i in range(24)}  # 48 MiB
expected = digests.layout_digest((name, "bfloat16", (1 << 20,), digests.tensor_digest(
    memoryview(tensor.cpu().view(torch.uint8).numpy()))) for name, tensor in state.items())
with Client(ENDPOINT) as c:
    print("published", publish_version(c, "gpu-digest", state, digest=False), c.lookup("gpu-digest").mechanism)
    with open_tensors(c, "gpu-digest", digest=expected) as opened:  # waits for the daemon's hashing
        print("digest", opened.digest == expected, opened.version)
    checks = c.status()["devices"][0]["digest_checks"]
    print("computed", checks["computed"], checks["bytes_hashed"] >= 48 << 20)
    c.unpublish("gpu-digest")
""", cuda_daemon.endpoint, timeout=240)
    assert "published 1 vmm" in out and "digest True 1" in out and "computed 1 True" in out, out
