"""Clients that run as other users (as root: ``setpriv`` to uids of their own, in the daemon's ``--group``), and
the forger of digests they can be: ``python -m tests.adversarial.other_uid ENDPOINT CHECKPOINT NAME`` publishes
other bytes as ``NAME`` with the manifest ``cuctx load CHECKPOINT`` would make, digests of the real file
included (issue 40, item 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, client_env

#: The group the daemon opens its socket to (``--group``), and the uids of the two other users, both in it.
GROUP = 65534
FORGER_UID = 65534
OWNER_UID = 65533

#: Tests that run clients as other uids need root (and ``setpriv``) to become them.
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="running a client as another uid needs root and setpriv")


def as_uid(uid: int) -> list[str]:
    """The command prefix that runs a command as ``uid``, in :data:`GROUP` only."""
    return ["setpriv", f"--reuid={uid}", f"--regid={GROUP}", "--clear-groups"]


def run_as(uid: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` as ``uid`` (from the repository, output captured)."""
    return subprocess.run([*as_uid(uid), sys.executable, *args], capture_output=True, text=True, env=client_env(),
                          cwd=REPO, timeout=timeout)


def cuctx_as(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``cuctx`` CLI as ``uid``."""
    return run_as(uid, "-m", "cuctxd.client", *args)


def readable_by_all(path: Path) -> Path:
    """``path`` (a directory of files) readable by every uid, so other users' clients can load from it."""
    path.chmod(0o755)
    for child in path.iterdir():
        child.chmod(0o644)
    return path


def forge(endpoint: str, path: str, name: str) -> None:
    """Publish ``size`` bytes of 0x5A as ``name`` with the layout and digests ``cuctx load path`` would publish."""
    from cuctxd import Client
    from cuctxd.client.tensors.checkpoints import read_checkpoint
    from cuctxd.client.tensors.hashing import hash_views
    from cuctxd.client.tensors.publishing import layout_offsets, publish_filled
    from cuctxd.client.tensors.safetensors_load import checkpoint_digest
    from cuctxd.protos.layouts import Manifest, TensorSpec, c_strides

    checkpoint = read_checkpoint(path)
    offsets, size = layout_offsets(t.nbytes for t in checkpoint.tensors)
    manifest = Manifest(tuple(TensorSpec(t.name, t.dtype, t.shape, c_strides(t.shape), offset)
                              for t, offset in zip(checkpoint.tensors, offsets, strict=True)), checkpoint.metadata)
    files = [Path(shard.path).read_bytes() for shard in checkpoint.shards]
    found = hash_views([memoryview(files[t.shard])[t.offset:t.offset + t.nbytes] for t in checkpoint.tensors])
    with Client(endpoint, name="forger") as client:
        buffer = client.alloc(size, 0, shareable=True)
        buffer.write(b"\x5a" * size)
        published = publish_filled(client, name, manifest, buffer, found)
    claimed = Manifest.digested(tuple(TensorSpec(s.name, s.dtype, s.shape, s.strides, s.offset, d)
                                      for s, d in zip(manifest.tensors, found, strict=True)), {}).digest
    assert claimed == checkpoint_digest(checkpoint), "the forgery claims the real layout digest"
    print(published.share_id)


if __name__ == "__main__":
    forge(*sys.argv[1:4])
