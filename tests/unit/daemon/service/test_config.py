"""The daemon's configuration: the TOML file, flags over the file, checks naming the key, --print-config."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import os
import tomllib
from pathlib import Path

import pytest

from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.registry.backlogs import QueueLimits
from cuctxd.daemon.registry.daemon_state import AdmissionLimits
from cuctxd.daemon.service.cli import build_parser, parse_config
from cuctxd.daemon.service.config import SETTINGS, ConfigError, DaemonConfig, check_config
from cuctxd.daemon.service.config_file import load_file, render_toml
from cuctxd.daemon.settings import count, declared, format_size, parse_size, part_of

MiB = 1 << 20


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cuctxd.toml"
    path.write_text(text)
    return path


def config_from(tmp_path: Path, text: str, *flags: str) -> DaemonConfig:
    config, _ = parse_config(["--config", str(write(tmp_path, text)), *flags])
    return config


def test_every_key_is_read_from_the_file(tmp_path: Path) -> None:
    key_file = tmp_path / "server.key_secret"
    key_file.write_text("")
    allow = tmp_path / "allowed"
    allow.mkdir()
    group = grp.getgrgid(os.getgid()).gr_name
    config = config_from(tmp_path, f"""
        endpoints = ["ipc:///tmp/x/a.sock", "tcp://127.0.0.1:5555"]
        backend = "sim"
        sim_devices = 3
        sim_memory = "8GiB"
        devices = [2, 0]
        max_payload = 4096
        lease_ttl = 2.5
        session_quota = "512MiB"
        device_reserve = "1GiB"
        drain_timeout = 3
        log_level = "debug"
        log_format = "json"
        metrics_port = 9400
        metrics_host = "0.0.0.0"
        group = "{group}"
        insecure_tcp = true
        server_key = "{key_file}"
        allow_dir = "{allow}"
        max_sessions_per_peer = 4
        max_objects_per_session = 1000
        busy_poll_us = 50
    """)
    assert config == DaemonConfig(
        endpoints=("ipc:///tmp/x/a.sock", "tcp://127.0.0.1:5555"), backend="sim", sim_devices=3,
        sim_memory=8 << 30, devices=(2, 0), max_payload=4096, lease_ttl=2.5, session_quota=512 * MiB,
        device_reserve=1 << 30, drain_timeout=3.0, log_level="DEBUG", log_format="json", metrics_port=9400,
        metrics_host="0.0.0.0", group=group, insecure_tcp=True, server_key=str(key_file), allow_dir=str(allow),
        max_sessions_per_peer=4, max_objects_per_session=1000, busy_poll_us=50,
    )


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = config_from(tmp_path, 'sim_devices = 3\nlog_format = "json"\nendpoints = ["ipc:///tmp/x/f.sock"]\n',
                         "--sim-devices", "1", "--endpoint", "ipc:///tmp/x/flag.sock")
    assert config.sim_devices == 1
    assert config.endpoints == ("ipc:///tmp/x/flag.sock",)
    assert config.log_format == "json"  # not given as a flag: the file's value stays


def test_a_flag_can_turn_a_file_boolean_off(tmp_path: Path) -> None:
    text = 'insecure_tcp = true\nendpoints = ["tcp://127.0.0.1:5555"]\n'
    assert config_from(tmp_path, text).insecure_tcp is True
    with pytest.raises(SystemExit) as exit_info:
        config_from(tmp_path, text, "--no-insecure-tcp")  # then tcp:// has no protection: refused
    assert exit_info.value.code == 2


def test_primary_keep_takes_zero() -> None:
    config, _ = parse_config(["--primary-keep", "0"])
    assert config.primary_keep == 0.0
    assert DaemonConfig(endpoints=("ipc:///tmp/x/d.sock",)).primary_keep == 60.0


def test_defaults_without_a_file() -> None:
    config, print_config = parse_config(["--endpoint", "ipc:///tmp/x/d.sock"])
    assert not print_config
    assert config == DaemonConfig(endpoints=("ipc:///tmp/x/d.sock",))


@pytest.mark.parametrize(("text", "key", "says"), [
    ("sim_memroy = '1GiB'", "sim_memroy", "did you mean 'sim_memory'"),
    ("frobnicate = 1", "frobnicate", "unknown key"),
    ("sim_devices = '2'", "sim_devices", "must be an integer"),
    ("sim_devices = true", "sim_devices", "must be an integer"),
    ("sim_devices = 99", "sim_devices", "1..16"),
    ("sim_memory = 'lots'", "sim_memory", "not a size"),
    ("sim_memory = 1.5", "sim_memory", "not a size"),
    ("max_payload = 0", "max_payload", "at least 1"),
    ("session_quota = -1", "session_quota", "negative"),
    ("lease_ttl = 0", "lease_ttl", "positive"),
    ("lease_ttl = 'soon'", "lease_ttl", "number of seconds"),
    ("drain_timeout = -1", "drain_timeout", "positive"),
    ("primary_keep = -1", "primary_keep", "0 or a positive number of seconds"),
    ("primary_keep = 'long'", "primary_keep", "number of seconds"),
    ("log_format = 'xml'", "log_format", "text, json"),
    ("log_level = 'LOUD'", "log_level", "DEBUG"),
    ("backend = 'opencl'", "backend", "auto, cuda, sim"),
    ("endpoints = 'ipc:///tmp/x'", "endpoints", "array"),
    ("endpoints = []", "endpoints", "non-empty"),
    ("endpoints = ['http://x']", "endpoints", "not an ipc:// or tcp://"),
    ("endpoints = ['tcp://127.0.0.1']", "endpoints", "needs a host and a port"),
    ("endpoints = ['localhost:5555']", "endpoints", "tcp://localhost:5555"),
    ("sim_devices = 0", "sim_devices", "1..16"),
    ("devices = [0, 0]", "devices", "twice"),
    ("devices = [-1]", "devices", ">= 0"),
    ("metrics_port = 70000", "metrics_port", "0..65535"),
    ("insecure_tcp = 'yes'", "insecure_tcp", "true or false"),
    ("group = 'no-such-group-cuctxd'", "group", "no such group"),
    ("server_key = '/nonexistent/key'", "server_key", "not a readable file"),
    ("allow_dir = '/nonexistent/dir'", "allow_dir", "not a directory"),
    ("max_objects_per_session = -3", "max_objects_per_session", ">= 0"),
    ("busy_poll_us = 2000000", "busy_poll_us", "0..1000000"),
    ("[metrics]\nport = 1", "metrics", "unknown key"),
])
def test_a_bad_value_names_its_key(tmp_path: Path, text: str, key: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_file(path)
    assert error.value.key == key
    assert f"'{key}'" in str(error.value)
    assert str(path) in str(error.value)
    assert says in str(error.value)


def test_not_toml_and_no_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_file(write(tmp_path, "sim_devices = = 2"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(tmp_path / "absent.toml")


def test_a_bad_file_exits_2_with_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_from(tmp_path, "sim_memory = 'lots'")
    assert exit_info.value.code == 2
    assert "cuctxd: configuration key 'sim_memory'" in capsys.readouterr().err


def test_a_bad_flag_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--lease-ttl", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--lease-ttl" in err
    assert "positive" in err


def test_tcp_needs_a_server_key_or_insecure_tcp() -> None:
    plain = DaemonConfig(endpoints=("ipc:///tmp/x/a.sock", "tcp://127.0.0.1:5555"))
    with pytest.raises(ConfigError) as error:
        check_config(plain)
    assert error.value.key == "endpoints"
    assert "insecure_tcp" in str(error.value) and "server_key" in str(error.value)
    check_config(DaemonConfig(endpoints=plain.endpoints, insecure_tcp=True))
    check_config(DaemonConfig(endpoints=plain.endpoints, server_key="/etc/cuctxd/server.key_secret"))
    check_config(DaemonConfig(endpoints=("ipc:///tmp/x/a.sock",)))


def test_print_config_reads_back_to_the_same_configuration(tmp_path: Path) -> None:
    config = config_from(tmp_path, 'sim_memory = "96MiB"\ndevices = [1]\nlease_ttl = 0.25\nmax_payload = 1001\n'
                         'endpoints = ["ipc:///tmp/x/q\\"uote.sock"]\n', "--log-format", "json")
    text = render_toml(config)
    assert 'sim_memory = "96MiB"' in text
    assert "max_payload = 1001" in text
    assert "# server_key is not set" in text
    unset = {"group", "server_key", "allow_dir", "sim_fault", "kubernetes_api"}
    assert set(tomllib.loads(text)) == set(SETTINGS) - unset
    again = config_from(tmp_path, text)
    assert again == config


def test_print_config_flag() -> None:
    config, print_config = parse_config(["--print-config", "--sim-devices", "4"])
    assert print_config
    assert "sim_devices = 4" in render_toml(config)


@pytest.mark.parametrize(("size", "text"), [(0, 0), (999, 999), (1000, "1KB"), (1 << 30, "1GiB"), (3 << 20, "3MiB"),
                                            ((1 << 30) + 1, (1 << 30) + 1), (1536 << 20, "1536MiB"),
                                            (2 * 10**9, "2GB"), (1000 << 10, "1000KiB")])
def test_sizes_render_and_parse_back(size: int, text: str | int) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "size"), [
    ("512M", 512 * MiB), ("512m", 512 * MiB), ("512MiB", 512 * MiB), ("1G", 1 << 30), ("2T", 2 << 40),
    ("4K", 4096), ("4kib", 4096), ("1.5G", 1536 * MiB),
    ("1KB", 1000), ("512MB", 512 * 10**6), ("1GB", 10**9), ("1TB", 10**12), ("64", 64), ("64B", 64),
])
def test_single_letter_suffixes_are_binary_and_kb_mb_gb_decimal(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_size_prints_back_as_it_was_given() -> None:
    config, _ = parse_config(["--sim-memory", "512M", "--session-quota", "2GB", "--device-reserve", "4K"])
    text = render_toml(config)
    assert 'sim_memory = "512MiB"' in text
    assert 'session_quota = "2GB"' in text
    assert 'device_reserve = "4KiB"' in text


def test_every_setting_is_one_declaration_with_its_key_flag_and_default_in_help() -> None:
    parser = build_parser()
    flags = {option: action for action in parser._actions for option in action.option_strings}
    assert sorted(SETTINGS) == sorted(field.name for field in dataclasses.fields(DaemonConfig))
    for name, declared_setting in SETTINGS.items():
        action = flags[declared_setting.flag]
        assert action.dest == name
        shown = declared_setting.shown_default()
        if not declared_setting.user:
            assert action.help == argparse.SUPPRESS, f"{name} is no user setting: only --help-all lists it"
            continue
        assert action.help is not None and (shown is None or f"(default {shown}" in action.help), name
    assert SETTINGS["max_payload"].help_text().endswith("(default 1GiB)")
    assert SETTINGS["max_queued_requests"].help_text().endswith("(default 512; 0: no limit)")
    assert SETTINGS["lease_ttl"].shown_default() == "5 s"
    assert SETTINGS["endpoints"].flag == "--endpoint"


def test_every_max_key_is_a_limit() -> None:
    assert all(declared_setting.limit for name, declared_setting in SETTINGS.items() if name.startswith("max_"))


def test_a_field_without_a_declaration_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Partial:
        declared_one: int = count(1, "a count")
        plain: int = 2

    with pytest.raises(TypeError, match=r"Partial\.plain"):
        declared(Partial)


def test_a_setting_declared_by_two_parts_is_refused() -> None:
    """The union of the parts' limits objects has each key once: a second declaration is an error, not a
    silent override."""
    @dataclasses.dataclass(frozen=True)
    class Widgets:
        max_widgets: int = count(1, "a count")

    @dataclasses.dataclass(frozen=True)
    class MoreWidgets:
        max_widgets: int = count(2, "the same key again")

    @dataclasses.dataclass(frozen=True)
    class Both(Widgets, MoreWidgets):
        pass

    with pytest.raises(TypeError, match=r"max_widgets.*Widgets and MoreWidgets"):
        declared(Both)


def test_each_part_gets_its_own_limits_object_with_the_configured_values() -> None:
    config, _ = parse_config(["--max-payload", "4M", "--primary-keep", "0", "--max-queued-requests", "7",
                              "--lease-ttl", "2"])
    device = part_of(config, DeviceLimits)
    assert type(device) is DeviceLimits and device.max_payload == 4 << 20 and device.primary_keep == 0
    assert part_of(config, QueueLimits) == QueueLimits(max_queued_requests=7)
    admission = part_of(config, AdmissionLimits)
    assert (admission.max_payload, admission.lease_ttl) == (4 << 20, 2.0)


def _settings_listed(help_text: str) -> set[str]:
    words = set(help_text.replace(",", " ").split())
    return {name for name, each in SETTINGS.items() if each.flag in words}


def test_help_lists_the_user_settings_and_help_all_every_one() -> None:
    """``--help`` is for the settings a user sets (at most 20); the limits, fd internals, tuning knobs and
    testing aids are in ``--help-all``, which lists every setting with its help and default."""
    short = build_parser().format_help()
    listed = _settings_listed(short)
    assert listed == {name for name, each in SETTINGS.items() if each.user}
    assert 10 <= len(listed) <= 20
    assert {"endpoints", "backend", "session_quota", "lease_ttl", "server_key"} <= listed
    assert not {"max_client_fds_per_session", "sim_fault", "sim_vmm", "busy_poll_us"} & listed
    assert f"{len(SETTINGS) - len(listed)} more settings" in " ".join(short.split())
    everything = build_parser(every=True)
    assert _settings_listed(everything.format_help()) == set(SETTINGS)
    helps = {action.dest: action.help for action in everything._actions}
    assert all(helps[name] == each.help_text() for name, each in SETTINGS.items())
