"""README.md as a user meets it: every Python example runs as it stands, and the two set-up
commands (run the daemon, run the tests) name programs, extras and subcommands that exist.

Each ```python block runs in its own process, in the README's order (the sharing consumer
follows its producer), with ``CUCTXD_ENDPOINT`` pointing at a sim daemon (the Ray example's local
Ray node hands it to its workers). Blocks that need a cluster (kubectl) are marked ```console and
do not run here.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProcess, client_env, cuctx, cuctxd

README = (REPO / "README.md").read_text()
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())


def fenced(language: str) -> list[str]:
    """The bodies of the README's fenced blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def sh_line(needle: str) -> str:
    """The one line of the README's ```sh blocks that contains ``needle``."""
    lines = [line for block in fenced("sh") for line in block.splitlines() if needle in line]
    assert len(lines) == 1, f"expected one shell line with {needle!r}, found {lines}"
    return lines[0]


def test_every_python_example_runs_against_a_sim_daemon(daemon: DaemonProcess) -> None:
    blocks = fenced("python")
    assert len(blocks) >= 4, "the README's Python examples were not found"
    env = dict(client_env(), CUCTXD_ENDPOINT=daemon.endpoint)
    outputs = []
    for index, block in enumerate(blocks):
        done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env,
                              timeout=60, cwd=REPO)
        assert done.returncode == 0, f"README python block {index} failed:\n{block}\n{done.stderr}"
        outputs.append(done.stdout)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in outputs[0], "the first example shows a CudaError's name"


def test_the_examples_import_from_the_cuctxd_namespace() -> None:
    for block in fenced("python"):
        imports = re.findall(r"^\s*(?:from|import) (\S+)", block, re.MULTILINE)
        allowed = {"cuctxd", "torch", "ray", "numpy", "safetensors"}  # the last three: the Ray example's
        assert all(name.split(".")[0] in allowed for name in imports), imports


def test_the_daemon_command_runs_the_installed_console_script() -> None:
    line = sh_line(".venv/bin/cuctxd")
    assert line.startswith("python3 -m venv .venv && .venv/bin/pip install -q -e . &&")
    scripts = PYPROJECT["project"]["scripts"]
    for name in ("cuctxd", "cuctx"):
        module, function = scripts[name].split(":")
        assert callable(getattr(importlib.import_module(module), function)), scripts[name]
    assert "`python -m cuctxd.daemon` is the same program" in README
    done = cuctxd("--help")
    assert done.returncode == 0 and "--backend" in done.stdout, done.stderr


def test_the_client_calls_that_show_it_works_work(daemon: DaemonProcess) -> None:
    line = sh_line(".venv/bin/cuctx ping")
    subcommands = re.findall(r"\.venv/bin/cuctx (\w+)", line)
    assert subcommands == ["ping", "devices", "status"]
    for subcommand in subcommands:
        done = cuctx("--endpoint", daemon.endpoint, subcommand)
        assert done.returncode == 0, f"cuctx {subcommand}: {done.stderr}"
        assert done.stdout.strip(), f"cuctx {subcommand} printed nothing"


def test_the_test_command_is_the_one_ci_runs() -> None:
    line = sh_line("pytest")
    assert line == "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q"
    extras = PYPROJECT["project"]["optional-dependencies"]["test"]
    assert any(requirement.startswith(("pytest>", "pytest=")) for requirement in extras), extras
    assert line in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", re.findall(r"`((?:daemon|protos|client|tests|bench)/[\w./]+\.\w+)`", README))
def test_files_the_readme_names_exist(path: str) -> None:
    assert (REPO / path).is_file(), path
