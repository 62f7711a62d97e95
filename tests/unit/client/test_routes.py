"""cuctxd.client.wire.routes: which transport a request takes, and when it must wait for another one's requests."""

from __future__ import annotations

from cuctxd.client.wire.routes import MAIN, Route, Routes, device_endpoints, shm_via

IPC = "ipc:///run/user/1000/cuctxd/cuctxd.sock"
DEVICES = [[f"{IPC}-dev0"], [f"{IPC}-dev1"]]


def test_ipc_device_endpoints_are_the_daemons_strings() -> None:
    assert device_endpoints(IPC, [IPC], DEVICES) == [f"{IPC}-dev0", f"{IPC}-dev1"]


def test_an_endpoint_the_daemon_did_not_report_gets_no_device_endpoints() -> None:
    assert device_endpoints("ipc:///elsewhere.sock", [IPC], DEVICES) == []
    assert device_endpoints(IPC, [IPC], []) == []


def test_tcp_device_endpoints_keep_the_host_the_client_used_and_take_the_devices_port() -> None:
    endpoints = [IPC, "tcp://0.0.0.0:5555"]
    per_device = [[f"{IPC}-dev0", "tcp://0.0.0.0:40001"], [f"{IPC}-dev1", "tcp://0.0.0.0:40002"]]
    assert device_endpoints("tcp://gpu-box:5555", endpoints, per_device) == [
        "tcp://gpu-box:40001", "tcp://gpu-box:40002"]
    assert device_endpoints("tcp://gpu-box:6666", endpoints, per_device) == []


def test_a_short_column_means_no_device_endpoints() -> None:
    assert device_endpoints("tcp://h:5555", [IPC, "tcp://h:5555"], [[f"{IPC}-dev0"]]) == []


def test_front_ops_take_the_main_endpoint_and_reach_every_device() -> None:
    routes = Routes(["a", "b"])
    assert routes.route("ping", {}) == Route(MAIN, None)
    assert routes.route("status", {}) == Route(MAIN, None)


def test_device_ops_follow_the_device_argument_then_the_current_device() -> None:
    routes = Routes(["a", "b"])
    assert routes.route("alloc", {"size": 1}) == Route(0, frozenset({0}))
    assert routes.route("alloc", {"size": 1, "device": 1}) == Route(1, frozenset({1}))
    assert routes.route("set_device", {"device": 1}) == Route(1, frozenset({1}))
    assert routes.route("alloc", {"size": 1}) == Route(1, frozenset({1}))


def test_a_device_the_daemon_lacks_goes_to_the_main_endpoint_for_its_error() -> None:
    routes = Routes(["a", "b"])
    assert routes.route("set_device", {"device": 5}) == Route(MAIN, None)
    assert routes.current_device == 0
    assert routes.route("alloc", {"device": True}) == Route(MAIN, None)


def test_without_device_endpoints_everything_takes_the_main_endpoint() -> None:
    assert Routes([]).route("alloc", {"size": 1}) == Route(MAIN, None)


def test_cross_device_copies_reach_both_devices() -> None:
    assert Routes(["a", "b"]).route("copy", {"device": 0, "dst_device": 1}).reach == frozenset({0, 1})


def test_waiting_is_needed_only_across_transports_for_shared_devices() -> None:
    on_0, on_1 = Route(0, frozenset({0})), Route(1, frozenset({1}))
    assert not Routes.conflicts(on_0, 0, [frozenset({0})])  # same socket: ZeroMQ keeps the order
    assert not Routes.conflicts(on_1, 0, [frozenset({0})])  # other device
    assert Routes.conflicts(on_1, 0, [frozenset({0, 1})])  # a copy into device 1 is in flight
    assert Routes.conflicts(on_1, MAIN, [None])  # a front op in flight
    assert Routes.conflicts(Route(MAIN, None), 1, [frozenset({1})])  # a front op after device work


def test_an_shm_lane_has_a_route_of_its_own_to_its_device() -> None:
    assert [shm_via(device) for device in (0, 1)] == [-2, -3]
    assert [Route(via, None).device for via in (MAIN, 0, 3, shm_via(0), shm_via(3))] == [MAIN, 0, 3, 0, 3]
    on_lane_1 = Route(shm_via(1), frozenset({1}))
    assert Routes.conflicts(on_lane_1, 1, [frozenset({1})])  # the device endpoint's request goes first
    assert not Routes.conflicts(on_lane_1, shm_via(0), [frozenset({0})])  # another device's lane
    assert Routes.conflicts(Route(1, frozenset({1})), shm_via(1), [frozenset({1})])  # and the other way round
