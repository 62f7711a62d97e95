"""``python -m bench.walk``: the walk of one ``Client.alloc`` names the files it visits on both sides."""

from __future__ import annotations

from bench.walk import walk


def test_the_walk_of_an_alloc_goes_from_the_client_through_the_lane_to_the_memory_handler_and_back() -> None:
    found = walk()
    client = [path for _, path in found["client"]]
    daemon = [path for _, path in found["daemon"]]
    # the method the client class holds is made from the call's one definition (client/ARCHITECTURE.md)
    assert client[:2] == ["client/api/flavours.py", "client/api/calls.py"] and client[-1] == "client/api/objects.py"
    assert "client/api/client.py" in client  # Client.run and the choice of transport
    assert "client/wire/shm_lane.py" in client  # the default path of a small device op
    assert "daemon/handlers/memory_ops.py" in daemon and "daemon/worker/lane.py" in daemon
    assert {thread for thread, _ in found["daemon"]} == {"cuctxd-device-0"}  # the front thread is not on it
