"""``preload`` entries as the file and the flag write them, and what is refused."""

from __future__ import annotations

import pytest

from cuctxd.daemon.service.config_file import build_config, check_value, render_toml
from cuctxd.daemon.service.preload import Preload, preload_entry, preload_list


@pytest.mark.parametrize(("written", "expected"), [
    ("llama=/models/llama", Preload("llama", "/models/llama", (0,))),
    ("llama=/models/llama@1", Preload("llama", "/models/llama", (1,))),
    ("llama=/models/a@b/llama@0,1", Preload("llama", "/models/a@b/llama", (0, 1))),
    ({"name": "llama", "path": "/models/llama", "devices": [0, 2]}, Preload("llama", "/models/llama", (0, 2))),
    ({"name": "llama", "path": "/models/llama"}, Preload("llama", "/models/llama", (0,))),
])
def test_an_entry_is_a_table_or_name_equals_path(written: object, expected: Preload) -> None:
    assert preload_entry(written) == expected
    assert preload_entry(expected.text()) == expected


@pytest.mark.parametrize("written", ["/models/llama", "=/models/llama", "llama=", "llama=/m@x", "llama=/m@",
                                     {"name": "llama"}, {"name": "llama", "path": "/m", "devices": []},
                                     {"name": "llama", "path": "/m", "devices": [-1]},
                                     {"name": "llama", "path": "/m", "device": 0}, 3])
def test_a_malformed_entry_is_refused_saying_why(written: object) -> None:
    with pytest.raises(ValueError):
        preload_entry(written)


def test_several_devices_publish_one_name_each() -> None:
    assert Preload("m", "/m", (0,)).targets() == [("m", 0)]
    assert Preload("m", "/m", (0, 1)).targets() == [("m@0", 0), ("m@1", 1)]


def test_the_file_takes_tables_and_print_config_gives_them_back_as_flags_write_them() -> None:
    written = [{"name": "m", "path": "/m", "devices": [1]}, "n=/n"]
    config = build_config({"preload": check_value("preload", written)}, {}, "ipc:///tmp/x")
    assert config.preload == preload_list(["m=/m@1", "n=/n@0"])
    assert 'preload = ["m=/m@1", "n=/n@0"]' in render_toml(config)
