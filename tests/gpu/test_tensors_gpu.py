"""Tensors by name on a real GPU: a producer publishes a timm model's state dict and exits; worker
processes load it zero-copy through cuctxd.client.tensors.torch_weights and compute what a private copy does."""

from __future__ import annotations

from cuctxd import Client
from cuctxd.client.tensors.torch_weights import load_state_dict
from tests.helpers import DaemonProcess, run_client

COMMON = """
import torch, timm
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1)).cuda()
"""

PRODUCER = COMMON + """
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import publish_state_dict
model = timm.create_model("resnet18", pretrained=False, num_classes=10).cuda().eval()
with torch.no_grad():
    print("expected", model(x).double().sum().item(), flush=True)
with Client(ENDPOINT) as c:
    d = publish_state_dict(c, "resnet18-weights", model, {"arch": "resnet18"})
    print("published", d.size)
"""

WORKER = COMMON + """
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import load_state_dict
model = timm.create_model("resnet18", pretrained=False, num_classes=10).cuda().eval()  # its own random weights
with Client(ENDPOINT) as c, load_state_dict(c, "resnet18-weights") as loaded:
    model.load_state_dict(loaded.state_dict, assign=True)  # the module now uses the daemon's memory
    first = next(iter(loaded.state_dict.values()))
    same = model.conv1.weight.data_ptr() == loaded.state_dict["conv1.weight"].data_ptr()
    with torch.no_grad():
        print("got", model(x).double().sum().item(), same, loaded.metadata["arch"], flush=True)
"""


def test_workers_compute_with_the_published_weights_zero_copy(cuda_daemon: DaemonProcess) -> None:
    produced = run_client(PRODUCER, cuda_daemon.endpoint, timeout=300)
    expected = next(line.split()[1] for line in produced.splitlines() if line.startswith("expected"))
    with Client(cuda_daemon.endpoint) as keeper, load_state_dict(keeper, "resnet18-weights") as held:
        assert len(held.state_dict) > 100
        for _ in range(2):
            out = run_client(WORKER, cuda_daemon.endpoint, timeout=300)
            line = next(x for x in out.splitlines() if x.startswith("got")).split()
            assert line[1] == expected and line[2:] == ["True", "resnet18"], (out, expected)
        keeper.unpublish("resnet18-weights")


BFLOAT16 = """
import torch
from cuctxd import Client
from cuctxd.client.tensors.torch_weights import load_state_dict, publish_state_dict
weights = {"w": torch.randn(64, 64, device="cuda").to(torch.bfloat16), "b": torch.arange(5, device="cuda")}
with Client(ENDPOINT) as c:
    publish_state_dict(c, "bf16", weights)
    with load_state_dict(c, "bf16") as loaded:
        print("bf16", loaded.state_dict["w"].dtype, torch.equal(loaded.state_dict["w"], weights["w"]),
              torch.equal(loaded.state_dict["b"], weights["b"]))
    c.unpublish("bf16")
"""


def test_bfloat16_travels_as_its_bytes(cuda_daemon: DaemonProcess) -> None:
    out = run_client(BFLOAT16, cuda_daemon.endpoint, timeout=300)
    assert "bf16 torch.bfloat16 True True" in out, out


INTEROP = """
import torch, cupy
from cuctxd import Client
from cuctxd.client.tensors.publishing import publish_tensors
from cuctxd.client.tensors.tensor_sets import open_tensors
source = torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16)
with Client(ENDPOINT) as c:
    publish_tensors(c, "interop", {"x": source, "h": torch.ones(8, dtype=torch.float16, device="cuda")})
    with open_tensors(c, "interop", writable=True) as ts:
        by_dlpack = torch.from_dlpack(ts["x"])
        by_cai = torch.as_tensor(ts["x"], device="cuda")
        by_cupy = cupy.from_dlpack(ts["h"])
        ok = (torch.equal(by_dlpack, source), torch.equal(by_cai, source), float(by_cupy.sum()),
              by_dlpack.data_ptr() == by_cai.data_ptr() != source.data_ptr())
        by_dlpack[0, 0] = -1.0
        torch.cuda.synchronize()
        print("interop", *ok, float(torch.as_tensor(ts["x"], device="cuda")[0, 0]))
    c.unpublish("interop")
"""


def test_dlpack_and_the_array_interface_into_torch_and_cupy(cuda_daemon: DaemonProcess) -> None:
    out = run_client(INTEROP, cuda_daemon.endpoint, timeout=300)
    assert "interop True True 8.0 True -1.0" in out, out


CUPY = """
import cupy
from cuctxd import Client
from cuctxd.client.tensors.cupy_arrays import load_arrays, publish_arrays
with Client(ENDPOINT) as c:
    source = cupy.arange(1000, dtype=cupy.float32)
    publish_arrays(c, "cupy-arrays", {"x": source})
    with load_arrays(c, "cupy-arrays") as loaded:
        x = loaded.arrays["x"]
        print("cupy", type(x).__name__, bool((x == source).all()), x.data.ptr != source.data.ptr)
    c.unpublish("cupy-arrays")
"""


def test_the_cupy_adapter_maps_arrays_zero_copy(cuda_daemon: DaemonProcess) -> None:
    out = run_client(CUPY, cuda_daemon.endpoint, timeout=300)
    assert "cupy ndarray True True" in out, out
