"""The README's tensor lines on a real GPU (issue 29, item 9): its "Tensors by name" block runs as written
against a cuda daemon, and so do the other ways the README names to hand a tensor to torch; an opened
share's read/read_into/write (item 8) copy on the GPU as they do on the sim."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO, DaemonProcess, run_client

README = (REPO / "README.md").read_text()


def _tensor_block() -> str:
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)
                if "open_tensors" in b]
    return block


def test_the_readmes_tensor_block_runs_on_the_gpu(cuda_daemon: DaemonProcess) -> None:
    pytest.importorskip("torch")
    block = _tensor_block()
    assert 'tensors.backend == "cuda"' in block and "torch.from_dlpack(tensors[" in block
    out = run_client(f"import os\nos.environ['CUCTXD_ENDPOINT'] = ENDPOINT\n{block}\nprint('block ran')",
                     cuda_daemon.endpoint, timeout=300)
    assert "block ran" in out, out


TORCH_WAYS = """
import torch
from cuctxd import Client, open_tensors, publish_tensors
weights = {"w": torch.arange(1024, dtype=torch.float32, device="cuda")}
with Client(ENDPOINT) as c:
    publish_tensors(c, "readme-ways", weights)
    with open_tensors(c, "readme-ways") as tensors:  # the default: read-only views
        by_dlpack = torch.from_dlpack(tensors["w"])
        try:
            torch.as_tensor(tensors["w"], device="cuda")
            refused = "accepted"
        except TypeError as error:
            refused = "refused" if "read only" in str(error) else str(error)
    with open_tensors(c, "readme-ways", writable=True) as tensors:
        by_interface = torch.as_tensor(tensors["w"], device="cuda")
        same = torch.equal(by_interface, weights["w"]) and torch.equal(by_dlpack, weights["w"])
        print("ways", same, refused)
    c.unpublish("readme-ways")
"""


def test_every_torch_line_the_readme_names_does_what_it_says(cuda_daemon: DaemonProcess) -> None:
    pytest.importorskip("torch")
    out = run_client(TORCH_WAYS, cuda_daemon.endpoint, timeout=300)
    assert "ways True refused" in out, out


SHARE_BYTES = """
from cuctxd import Client
data = bytes(range(256)) * 16
with Client(ENDPOINT) as owner, Client(ENDPOINT) as reader:
    buf = owner.alloc(len(data), shareable=True)
    buf.write(data)
    with reader.open_shared(buf.export()) as shared:
        into = bytearray(100)
        shared.read_into(into, offset=256)
        shared.write(b"from the mapping", offset=8)
        print("bytes", shared.read()[:8] == data[:8], bytes(into) == data[256:356],
              buf.read(16, offset=8) == b"from the mapping")
"""


def test_an_opened_share_reads_and_writes_on_the_gpu(cuda_daemon: DaemonProcess) -> None:
    out = run_client(SHARE_BYTES, cuda_daemon.endpoint, timeout=300)
    assert "bytes True True True" in out, out
