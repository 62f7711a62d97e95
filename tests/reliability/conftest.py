"""The reliability suite's switches: ``--soak`` (or ``CUCTXD_SOAK=1``) for the long run, and a count of inputs.

In CI the suite is short and deterministic. The soak runs the same tests with
far more fuzz examples and load operations (see ``strategies.scaled``); the
option is registered here, so pass it with this directory on the command line
(``pytest tests/reliability --soak``), or set the environment variable, which
works from anywhere and also reaches the load test's client processes. The
counts of inputs run are printed at the end by the root ``conftest.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import remove_tempdir, short_tempdir


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the reliability suite as a long soak (same as CUCTXD_SOAK=1)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--soak", default=False):
        os.environ["CUCTXD_SOAK"] = "1"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private directory with a short path (for a notify socket, FIFOs and checkpoints), removed after."""
    directory = short_tempdir()
    yield directory
    remove_tempdir(directory)
