"""The shipped systemd unit: a notify service with a watchdog whose ExecStart the daemon accepts."""

from __future__ import annotations

import configparser
import shlex
import tomllib
from pathlib import Path

from cuctxd.daemon.service.cli import parse_config
from tests.helpers import REPO

UNIT = REPO / "daemon" / "systemd" / "cuctxd.service"


def service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def test_the_unit_is_a_restarting_notify_service_with_a_watchdog() -> None:
    unit = service()
    assert unit["Type"] == "notify"
    assert int(unit["WatchdogSec"]) > 0
    assert unit["Restart"] == "on-failure"
    assert unit["RestartPreventExitStatus"] == "2"  # a bad configuration: restarting would not help
    assert unit["RuntimeDirectory"] == "cuctxd"
    assert unit["RuntimeDirectoryMode"] == "0700"
    assert float(unit["TimeoutStopSec"]) > 10 + 5  # the default drain_timeout plus the workers' grace


def test_exec_start_listens_in_the_runtime_directory_and_parses(tmp_path: Path) -> None:
    argv = shlex.split(service()["ExecStart"])
    assert argv[0].endswith("/cuctxd")
    assert "ipc://%t/cuctxd/cuctxd.sock" in argv
    config = tmp_path / "cuctxd" / "cuctxd.toml"
    config.parent.mkdir()
    config.write_text("")  # an empty file: the defaults
    expanded = [a.replace("%t", "/run").replace("%E", str(tmp_path)) for a in argv[1:]]
    parsed, _ = parse_config(expanded)
    assert parsed.endpoints == ("ipc:///run/cuctxd/cuctxd.sock",)


def test_the_unit_ships_as_package_data() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "systemd/cuctxd.service" in project["tool"]["setuptools"]["package-data"]["cuctxd.daemon"]
