"""cuctxd.client.wire.routes: which socket a request takes, and when it must wait for another socket's requests."""

from __future__ import annotations

from cuctxd.client.wire.routes import FRONT, Lanes, Route, lane_endpoints

IPC = "ipc:///run/user/1000/cuctxd/cuctxd.sock"
DEVICES = [[f"{IPC}-dev0"], [f"{IPC}-dev1"]]


def test_ipc_lanes_are_the_daemons_strings() -> None:
    assert lane_endpoints(IPC, [IPC], DEVICES) == [f"{IPC}-dev0", f"{IPC}-dev1"]


def test_an_endpoint_the_daemon_did_not_report_gets_no_lanes() -> None:
    assert lane_endpoints("ipc:///elsewhere.sock", [IPC], DEVICES) == []
    assert lane_endpoints(IPC, [IPC], []) == []


def test_tcp_lanes_keep_the_host_the_client_used_and_take_the_devices_port() -> None:
    endpoints = [IPC, "tcp://0.0.0.0:5555"]
    per_device = [[f"{IPC}-dev0", "tcp://0.0.0.0:40001"], [f"{IPC}-dev1", "tcp://0.0.0.0:40002"]]
    assert lane_endpoints("tcp://gpu-box:5555", endpoints, per_device) == [
        "tcp://gpu-box:40001", "tcp://gpu-box:40002"]
    assert lane_endpoints("tcp://gpu-box:6666", endpoints, per_device) == []


def test_a_short_column_means_no_lanes() -> None:
    assert lane_endpoints("tcp://h:5555", [IPC, "tcp://h:5555"], [[f"{IPC}-dev0"]]) == []


def test_front_ops_take_the_main_endpoint_and_reach_every_device() -> None:
    lanes = Lanes(["a", "b"])
    assert lanes.route("ping", {}) == Route(FRONT, None)
    assert lanes.route("status", {}) == Route(FRONT, None)


def test_device_ops_follow_the_device_argument_then_the_current_device() -> None:
    lanes = Lanes(["a", "b"])
    assert lanes.route("alloc", {"size": 1}) == Route(0, frozenset({0}))
    assert lanes.route("alloc", {"size": 1, "device": 1}) == Route(1, frozenset({1}))
    assert lanes.route("set_device", {"device": 1}) == Route(1, frozenset({1}))
    assert lanes.route("alloc", {"size": 1}) == Route(1, frozenset({1}))


def test_a_device_the_daemon_lacks_goes_to_the_main_endpoint_for_its_error() -> None:
    lanes = Lanes(["a", "b"])
    assert lanes.route("set_device", {"device": 5}) == Route(FRONT, None)
    assert lanes.current_device == 0
    assert lanes.route("alloc", {"device": True}) == Route(FRONT, None)


def test_without_lanes_everything_takes_the_main_endpoint() -> None:
    assert Lanes([]).route("alloc", {"size": 1}) == Route(FRONT, None)


def test_cross_device_copies_reach_both_devices() -> None:
    assert Lanes(["a", "b"]).route("copy", {"device": 0, "dst_device": 1}).reach == frozenset({0, 1})


def test_waiting_is_needed_only_across_sockets_for_shared_devices() -> None:
    on_0, on_1 = Route(0, frozenset({0})), Route(1, frozenset({1}))
    assert not Lanes.conflicts(on_0, 0, [frozenset({0})])  # same socket: ZeroMQ keeps the order
    assert not Lanes.conflicts(on_1, 0, [frozenset({0})])  # other device
    assert Lanes.conflicts(on_1, 0, [frozenset({0, 1})])  # a copy into device 1 is in flight
    assert Lanes.conflicts(on_1, FRONT, [None])  # a front op in flight
    assert Lanes.conflicts(Route(FRONT, None), 1, [frozenset({1})])  # a front op after device work
