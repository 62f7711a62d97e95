"""A real daemon configured by a TOML file and flags: what it serves, what it refuses to start with."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuctxd.client import Client
from cuctxd.daemon.service.config import SETTINGS
from tests.helpers import (
    DaemonProcess,
    cuctxd,
    remove_tempdir,
    short_tempdir,
    start_daemon,
    wait_for_log,
)

MiB = 1 << 20


@pytest.fixture
def workdir() -> Iterator[Path]:
    directory = short_tempdir()
    yield directory
    remove_tempdir(directory)


def test_the_daemon_serves_what_its_file_says(workdir: Path, stop_after: list[DaemonProcess]) -> None:
    config = workdir / "cuctxd.toml"
    config.write_text('sim_devices = 3\nsim_memory = "32MiB"\nlease_ttl = 2.5\nmax_payload = "2MiB"\n')
    process = start_daemon("--config", str(config))
    stop_after.append(process)
    with Client(process.endpoint, timeout=10) as client:
        devices = client.devices()
        assert [d.total_memory for d in devices] == [32 * MiB] * 3
        assert client.lease_ttl == 2.5
        assert client.limits["max_payload_bytes"] == 2 * MiB


def test_flags_override_the_file(workdir: Path, stop_after: list[DaemonProcess]) -> None:
    config = workdir / "cuctxd.toml"
    config.write_text('sim_devices = 3\nsim_memory = "32MiB"\n')
    process = start_daemon("--config", str(config), "--sim-devices", "1")
    stop_after.append(process)
    with Client(process.endpoint, timeout=10) as client:
        assert [d.total_memory for d in client.devices()] == [32 * MiB]


def test_devices_serves_chosen_ordinals_as_0_to_n_minus_1(daemon: DaemonProcess,
                                                           stop_after: list[DaemonProcess]) -> None:
    """The module's 2-device daemon shows every sim device; --devices 1,0 shows them swapped."""
    with Client(daemon.endpoint, timeout=10) as everything:
        all_devices = everything.devices()
    process = start_daemon("--sim-devices", "2", "--sim-memory", "64MiB", "--devices", "1,0")
    stop_after.append(process)
    with Client(process.endpoint, timeout=10) as client:
        served = client.devices()
        assert [d.index for d in served] == [0, 1]
        assert [d.uuid for d in served] == [all_devices[1].uuid, all_devices[0].uuid]
        client.set_device(1)
        buffer = client.alloc(MiB, device=1)
        buffer.fill(7)
        assert buffer.read(4) == b"\x07" * 4
        assert client.current_context(1) is not None
        (dev0, dev1) = client.status()["devices"]
        assert [s["bytes"] for s in dev1["sessions"]] == [MiB]
        assert dev0["sessions"] == [] or all(s["bytes"] == 0 for s in dev0["sessions"])
    wait_for_log(process, re.escape("driver ordinals [1, 0]"))


def test_devices_the_driver_lacks_refuse_to_start(workdir: Path) -> None:
    done = cuctxd("--backend", "sim", "--sim-devices", "2", "--devices", "0,5",
                  "--endpoint", f"ipc://{workdir}/d.sock")
    assert done.returncode == 2, done.stderr
    assert "'devices'" in done.stderr and "ordinal 5" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("text", "key"), [
    ("unknown_thing = 1", "unknown_thing"),
    ("sim_devices = 'two'", "sim_devices"),
    ("sim_memory = '12 parsecs'", "sim_memory"),
    ("log_format = 'yaml'", "log_format"),
    ("endpoints = ['tcp://127.0.0.1:0']", "endpoints"),
])
def test_a_bad_file_exits_2_naming_the_key(workdir: Path, text: str, key: str) -> None:
    config = workdir / "bad.toml"
    config.write_text(text)
    done = cuctxd("--config", str(config), "--backend", "sim")
    assert done.returncode == 2
    assert f"configuration key '{key}'" in done.stderr
    assert "listening" not in done.stdout
    assert "Traceback" not in done.stderr


def test_print_config_shows_the_merge_and_exits_0(workdir: Path) -> None:
    config = workdir / "cuctxd.toml"
    config.write_text('sim_devices = 3\nsim_memory = 67108864\nlog_format = "json"\n')
    done = cuctxd("--config", str(config), "--sim-devices", "5", "--endpoint", "ipc:///tmp/x/y.sock",
                  "--print-config")
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert printed["sim_devices"] == 5
    assert printed["sim_memory"] == "64MiB"
    assert printed["log_format"] == "json"
    assert printed["endpoints"] == ["ipc:///tmp/x/y.sock"]
    (workdir / "printed.toml").write_text(done.stdout)
    again = cuctxd("--config", str(workdir / "printed.toml"), "--print-config")
    assert again.stdout == done.stdout


def test_tcp_without_curve_is_refused(workdir: Path) -> None:
    done = cuctxd("--backend", "sim", "--endpoint", "tcp://127.0.0.1:*")
    assert done.returncode == 2
    assert "--endpoint" in done.stderr and "--server-key" in done.stderr and "--insecure-tcp" in done.stderr
    assert "configuration key" not in done.stderr  # given on the command line, so named as a flag


def test_insecure_tcp_listens_and_warns(stop_after: list[DaemonProcess]) -> None:
    process = start_daemon("--endpoint", "tcp://127.0.0.1:*", "--insecure-tcp")
    stop_after.append(process)
    match = wait_for_log(process, r"tcp://127\.0\.0\.1:(\d+)")
    wait_for_log(process, r"WARNING .*WITHOUT encryption")
    with Client(match.group(0), timeout=10) as client:
        assert client.ping() > 0


def test_a_server_key_is_never_served_in_plaintext(workdir: Path) -> None:
    """CURVE asked for but not possible (no allow_dir, or no usable key): refuse to start, never listen without it."""
    key = workdir / "server.key_secret"
    key.write_text("")
    done = cuctxd("--backend", "sim", "--endpoint", "tcp://127.0.0.1:*", "--server-key", str(key))
    assert done.returncode == 2
    assert "'allow_dir'" in done.stderr
    assert "listening" not in done.stdout
    done = cuctxd("--backend", "sim", "--endpoint", "tcp://127.0.0.1:*", "--server-key", str(key),
                  "--allow-dir", str(workdir))
    assert done.returncode == 2
    assert "'server_key'" in done.stderr and "cannot load a CURVE key pair" in done.stderr
    assert "listening" not in done.stdout


# --- first contact: sizes, device counts and endpoints as people write them ------------------------


def test_zero_sim_devices_is_refused_before_start(workdir: Path) -> None:
    done = cuctxd("--backend", "sim", "--sim-devices", "0", "--endpoint", f"ipc://{workdir}/d.sock")
    assert done.returncode == 2
    assert "--sim-devices" in done.stderr and "1..16" in done.stderr
    assert "Traceback" not in done.stderr
    config = workdir / "zero.toml"
    config.write_text("sim_devices = 0\n")
    done = cuctxd("--backend", "sim", "--config", str(config), "--endpoint", f"ipc://{workdir}/d.sock")
    assert done.returncode == 2
    assert "configuration key 'sim_devices'" in done.stderr and "Traceback" not in done.stderr


def test_sizes_are_binary_and_print_as_given(stop_after: list[DaemonProcess]) -> None:
    done = cuctxd("--sim-memory", "512M", "--print-config")
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["sim_memory"] == "512MiB"
    process = start_daemon("--sim-memory", "48M", "--sim-devices", "1")
    stop_after.append(process)
    with Client(process.endpoint, timeout=10) as client:
        assert client.devices()[0].total_memory == 48 * MiB
    wait_for_log(process, r"1 simulated device\(s\) of 48 MiB")
    assert "bytes" not in wait_for_log(process, r"backend sim: .*").group(0)


def test_help_says_what_a_size_suffix_means() -> None:
    done = cuctxd("--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "powers of 1024" in text and "powers of 1000" in text


def test_help_lists_at_most_20_settings_and_help_all_lists_every_one() -> None:
    """``cuctxd --help`` is for the settings a user sets; ``--help-all`` adds the limits, fd internals,
    tuning knobs and testing aids, and every one of them parses whichever help lists it."""

    def settings_in(text: str) -> set[str]:
        words = set(text.replace(",", " ").split())
        return {name for name, each in SETTINGS.items() if each.flag in words}

    short = cuctxd("--help")
    assert short.returncode == 0, short.stderr
    listed = settings_in(short.stdout)
    assert 0 < len(listed) <= 20, sorted(listed)
    assert "--help-all" in short.stdout and "--max-client-fds" not in short.stdout
    full = cuctxd("--help-all")
    assert full.returncode == 0, full.stderr
    assert settings_in(full.stdout) == set(SETTINGS)
    hidden = cuctxd("--max-client-fds-per-session", "5", "--sim-vmm", "--print-config")
    assert hidden.returncode == 0 and "max_client_fds_per_session = 5" in hidden.stdout, hidden.stderr


@pytest.mark.parametrize(("endpoint", "says"), [
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("localhost:5555", "tcp://localhost:5555"),
    ("/tmp/x.sock", "ipc:///tmp/x.sock"),
    ("tcp://127.0.0.1:99999", "1..65535"),
])
def test_a_malformed_endpoint_is_refused_in_one_line(endpoint: str, says: str) -> None:
    done = cuctxd("--backend", "sim", "--endpoint", endpoint)
    assert done.returncode == 2
    assert says in done.stderr and "--endpoint" in done.stderr
    assert "Traceback" not in done.stderr
