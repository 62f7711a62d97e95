"""Version buffers recycled on a real GPU: a trainer process publishes 5 versions of a 256 MiB bf16 layout from its
torch tensors, an engine process moves to each and closes the older one; after warm-up (versions 1 and 2) neither
process imports or maps anything (their mapping caches' counters stay), the daemon reuses its spare for every
version, the engine reads each version's own bytes and reuses its views."""

from __future__ import annotations

from tests.helpers import DaemonProcess, run_client, spawn_client, wait_for_line

#: 64 bf16 tensors of 4 MiB: 256 MiB.
TENSORS, ELEMENTS, VERSIONS = 64, 2 << 20, 5

TRAINER = f"""
import torch
from cuctxd import Client
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors import publish_version, wait_version
params = {{f"layers.{{i}}.weight": torch.zeros({ELEMENTS}, dtype=torch.bfloat16, device="cuda")
          for i in range({TENSORS})}}
with Client(ENDPOINT) as c:
    for version in range(1, {VERSIONS} + 1):
        for tensor in params.values():
            tensor.fill_(version)
        torch.cuda.synchronize()
        assert publish_version(c, "gpu-ring", params) == version
        reused = c.status()["devices"][0]["spares"]["reused"]
        print("published", version, VMM_IMPORTS.imported, reused, flush=True)
        wait_version(c, "gpu-ring-ack", version - 1, timeout=120)  # the engine is at this version
"""

ENGINE = """
import numpy, torch
from cuctxd import Client
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.tensors import publish_version, wait_version
from cuctxd.client.tensors.torch_weights import load_state_dict
with Client(ENDPOINT) as c:
    wait_version(c, "gpu-ring", 0, timeout=120)
    held = load_state_dict(c, "gpu-ring")
    views = {held.version: held.state_dict["layers.0.weight"]}
    while True:
        values = torch.stack([t.float().min() for t in held.state_dict.values()]
                             + [t.float().max() for t in held.state_dict.values()])
        low, high = values.min().item(), values.max().item()
        reused = held.version > 2 and held.state_dict["layers.0.weight"] is views.get(held.version - 2)
        print("at", held.version, low, high, VMM_IMPORTS.imported, reused, flush=True)
        publish_version(c, "gpu-ring-ack", {"at": numpy.full(1, held.version)})
        if held.version == VERSIONS:
            break
        wait_version(c, "gpu-ring", held.version, timeout=120)
        newer = held.refresh()
        held.close()
        held = newer
        views[held.version] = held.state_dict["layers.0.weight"]
    held.close()
    c.unpublish("gpu-ring-ack")
"""


def test_after_warm_up_versions_reuse_their_buffers_and_nobody_maps_anything(cuda_daemon: DaemonProcess) -> None:
    with spawn_client(f"VERSIONS = {VERSIONS}\n{ENGINE}", cuda_daemon.endpoint) as engine, \
            spawn_client(TRAINER, cuda_daemon.endpoint) as trainer:
        published = [wait_for_line(trainer, f"published {v}", 300).split() for v in range(1, VERSIONS + 1)]
        seen = [wait_for_line(engine, f"at {v}", 300).split() for v in range(1, VERSIONS + 1)]
        assert engine.wait(120) == 0 and trainer.wait(120) == 0
    assert [(int(s[1]), float(s[2]), float(s[3])) for s in seen] == [(v, v, v) for v in range(1, VERSIONS + 1)]
    assert [int(s[4]) for s in seen] == [1, 2, 2, 2, 2]  # engine: no import, no map after version 2
    assert [s[5] for s in seen[2:]] == ["True"] * 3  # its views of the same buffer, reused
    assert [int(p[2]) for p in published] == [1, 2, 2, 2, 2]  # trainer: no export, import or map after warm-up
    # versions 3-5 went into a spare, nothing allocated (the engine's acks, versions of a name of their own, may
    # reuse spares too: the daemon's count is device-wide)
    reused = [int(p[3]) for p in published]
    assert all(found >= least for found, least in zip(reused, [0, 0, 1, 2, 3], strict=True)), reused
    out = run_client("""
from cuctxd import Client
with Client(ENDPOINT) as c:
    c.unpublish("gpu-ring")
    print("spares", c.status()["devices"][0]["spares"]["count"])
""", cuda_daemon.endpoint)
    assert "spares 0" in out, out
