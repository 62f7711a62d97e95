"""Fixtures of the adversarial suite; the helpers behind them are in :mod:`tests.adversarial.attacks`.

``attack_daemon``: a sim daemon (two devices, 256 MiB each) for one test,
started with ``attack_daemon_args`` (override that fixture in a test module to
add options, e.g. limits) and ``attack_daemon_open_files`` as its open-file
limit. On teardown it must still be alive and exit cleanly. A module whose
attacks all end with their own sessions overrides ``attack_daemon`` with a
module-scoped one (``attacks.attacked_daemon``), saving a start per test.
``bystander``: a session on it with a buffer of known bytes
(:class:`~tests.adversarial.attacks.Bystander`); on teardown its bytes are
checked once more.

Figures a test wants in the CI output go into ``attacks.FIGURES`` (lines
under the test's name); the root ``conftest.py`` prints them at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.adversarial.attacks import Bystander, assert_alive, attacked_daemon, open_bystander
from tests.helpers import DaemonProcess


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    """Extra options for ``attack_daemon``; a module overrides this fixture to change them."""
    return ()


@pytest.fixture
def attack_daemon_open_files() -> int | None:
    """The daemon's RLIMIT_NOFILE, soft and hard (None: the test runner's); a module overrides it."""
    return None


@pytest.fixture
def attack_daemon(attack_daemon_args: tuple[str, ...], attack_daemon_open_files: int | None) -> Iterator[DaemonProcess]:
    with attacked_daemon(*attack_daemon_args, open_files=attack_daemon_open_files) as process:
        yield process


@pytest.fixture
def bystander(attack_daemon: DaemonProcess) -> Iterator[Bystander]:
    with open_bystander(attack_daemon.endpoint) as innocent:
        yield innocent
        assert_alive(attack_daemon)
        innocent.check()
