"""What the wheel installs and says about itself: one top-level package, ``cuctxd``, with every subpackage of
the tree in it; the license text, who makes it, where it lives.

pyproject.toml lists the packages explicitly (the repository's root is mapped to ``cuctxd``), so a new
subpackage that is not listed would be missing from installs: this test fails first.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib

from tests.helpers import REPO

SHIPPED = ("protos", "daemon", "client")


def setuptools_table() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_root_is_the_cuctxd_package() -> None:
    assert setuptools_table()["package-dir"] == {"cuctxd": "."}
    assert (REPO / "__init__.py").is_file()


def test_the_root_holds_no_module_but_the_package_itself() -> None:
    """pytest, ``python -m`` and a checkout's shell put the root on ``sys.path``: a module there would be
    importable at the top level under its own name, shadowing any installed package it is named after (a
    ``ray.py`` did so to Ray). Modules live in the shipped folders, never beside ``__init__.py``."""
    assert sorted(path.name for path in REPO.glob("*.py")) == ["__init__.py"]


def test_every_subpackage_of_the_tree_is_listed_and_nothing_else() -> None:
    in_tree = {"cuctxd"} | {
        "cuctxd." + ".".join(init.parent.relative_to(REPO).parts)
        for top in SHIPPED for init in (REPO / top).rglob("__init__.py")
    }
    assert set(setuptools_table()["packages"]) == in_tree
    assert not any(name.startswith(("cuctxd.bench", "cuctxd.tests", "bench", "tests")) for name in in_tree)


def test_package_data_exists() -> None:
    for package, files in setuptools_table()["package-data"].items():
        folder = REPO.joinpath(*package.split(".")[1:])
        for name in files:
            assert (folder / name).is_file(), f"{package}: {name}"


def test_the_license_file_is_the_apache_2_0_text_pyproject_declares() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "9. Accepting Warranty or Additional Liability." in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_authors_and_urls() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["authors"] == [{"name": "cuctxd developers"}]
    assert set(project["urls"]) >= {"Homepage", "Repository", "Issues"}
    assert all(url.startswith("https://github.com/cuctxd/cuctxd") for url in project["urls"].values())


def test_the_entry_points_resolve() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"cuctxd", "cuctx", "cuctxd-device-plugin"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_extras_that_publish_checkpoints_bring_safetensors() -> None:
    for extra in ("ray", "transformers"):
        assert any(requirement.startswith("safetensors") for requirement in extras()[extra]), extra


def test_the_readme_curve_example_keys_are_ignored_by_git() -> None:
    secret = "keys/server.key_secret"  # what `cuctxd keygen keys` writes, as the README's CURVE example runs it
    assert secret in (REPO / "README.md").read_text() or "keygen keys" in (REPO / "README.md").read_text()
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", secret], cwd=REPO, check=False)
    assert ignored.returncode == 0, f"{secret} would be committed: .gitignore does not cover it"


def test_the_readme_sample_config_needs_nothing_the_quick_start_does_not_install() -> None:
    """The sample config runs on the quick start's install (``pip install -e .``): no setting that needs an extra
    (metrics_port needs ``metrics``) is on in it."""
    readme = (REPO / "README.md").read_text()
    (sample,) = re.findall(r"^```toml\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    assert tomllib.loads(sample).get("metrics_port", 0) == 0
    assert "pip install -q -e . &&" in readme  # the quick start: no extras


def test_the_daemon_loads_no_client_code_and_the_root_still_offers_the_clients_names() -> None:
    """The root package imports the client's public names lazily: a daemon (whose modules live beneath it)
    starts without importing any of ``cuctxd.client``, while ``from cuctxd import Client`` still works. Nor does
    it import asyncio or zmq.auth, which only CURVE and ``cuctxd keygen`` need (15 ms of every start)."""
    probe = ("import sys, cuctxd.daemon.service.cli\n"
             "print(sorted(m for m in sys.modules if m.startswith(('cuctxd.client', 'asyncio', 'zmq.auth'))))\n"
             "import cuctxd\n"
             "from cuctxd import Client, CudaError\n"
             "print(Client.__module__, CudaError.__module__, 'Client' in dir(cuctxd), 'Client' in cuctxd.__all__)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    loaded, names = done.stdout.splitlines()
    assert loaded == "[]", f"the daemon's start imported client modules, asyncio or zmq.auth: {loaded}"
    assert names == "cuctxd.client.api.client cuctxd.protos.errors True True", names
