"""The walk of one ``Client.alloc`` through the code, client and daemon side: which files it visits, in order.

``python -m bench.walk [OUT.json]`` starts a sim daemon of the ``cuctxd`` package it imports (set
``PYTHONPATH`` to walk another checkout), warms the default path (the shm lane) with five alloc/free pairs,
then traces one ``alloc`` of 1 MiB: in this process with :func:`sys.setprofile`, in the daemon with
:func:`threading.setprofile` on every thread, keeping the calls made between the client's call and its return
(``time.monotonic`` is one clock for both processes). A *stay* is a run of consecutive calls in one file of
the package, per thread; stdlib and third-party frames are left out. It prints the stays in order and their
count, and the files. Issue 42 compares walks before and after a refactor with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The daemon's process: the profile hook on every thread, its calls written out at exit.
_DAEMON = r"""
import atexit, json, os, sys, threading
sys.path[:0] = [os.environ["WALK_HOME"]]
from bench.walk import package_root, recorder
events = []
hook = recorder(package_root(), events)
def dump():
    sys.setprofile(None)
    threading.setprofile(None)
    with open(os.environ["WALK_OUT"], "w") as out:
        json.dump(events, out)
atexit.register(dump)
threading.setprofile(hook)
sys.setprofile(hook)
from cuctxd.daemon.service.cli import main
sys.exit(main(sys.argv[1:]))
"""

Call = tuple[float, str, str]


def package_root() -> str:
    """The directory of the ``cuctxd`` package imported here, with a trailing separator."""
    import cuctxd

    return os.path.dirname(os.path.realpath(cuctxd.__file__)) + os.sep


def recorder(root: str, sink: list[Call]) -> Callable[[FrameType, str, Any], None]:
    """A profile hook appending ``(time, thread, file)`` for each call into a file of the package at ``root``."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_filename.startswith("<"):  # "<string>": made by dataclasses
            return
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(root) and not path[len(root):].startswith((".venv", "bench", "scratch")):
            sink.append((time.monotonic(), threading.current_thread().name, path[len(root):]))

    return hook


def stays(calls: list[Call]) -> list[tuple[str, str]]:
    """The calls as stays: ``(thread, file)`` with consecutive repeats folded."""
    folded: list[tuple[str, str]] = []
    for _, thread, path in calls:
        if not folded or folded[-1] != (thread, path):
            folded.append((thread, path))
    return folded


def walk() -> dict[str, list[tuple[str, str]]]:
    """One traced ``alloc``'s stays, ``{"client": [...], "daemon": [...]}``."""
    workdir = tempfile.mkdtemp(prefix="cuctxd-walk-", dir="/tmp")
    endpoint = f"ipc://{workdir}/d.sock"
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, WALK_OUT=f"{workdir}/daemon.json", WALK_HOME=home)
    with open(f"{workdir}/daemon.log", "w") as log:  # the child has its own copy of the fd
        daemon = subprocess.Popen([sys.executable, "-c", _DAEMON, "--endpoint", endpoint, "--backend", "sim"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        root = package_root()
        client_calls: list[Call] = []
        with _connect(endpoint, daemon) as client:
            for _ in range(5):
                client.free(client.alloc(1 << 20))
            sys.setprofile(recorder(root, client_calls))
            started = time.monotonic()
            buffer = client.alloc(1 << 20)
            ended = time.monotonic()
            sys.setprofile(None)
            client.free(buffer)
    finally:
        daemon.terminate()
        daemon.wait(60)
    with open(f"{workdir}/daemon.json") as found:
        daemon_calls = [(at, thread, path) for at, thread, path in json.load(found) if started <= at <= ended]
    return {"client": stays(client_calls), "daemon": stays(daemon_calls)}


def _connect(endpoint: str, daemon: subprocess.Popen[bytes]) -> Any:
    from cuctxd import Client

    deadline = time.monotonic() + 60
    while True:
        try:
            return Client(endpoint, timeout=30)
        except Exception:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(argv: list[str]) -> int:
    result = walk()
    if argv:
        with open(argv[0], "w") as out:
            json.dump(result, out, indent=1)
    for side, folded in result.items():
        print(f"{side}: {len(folded)} stays in {len({path for _, path in folded})} files")
        for thread, path in folded:
            print(f"    {thread:20} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
