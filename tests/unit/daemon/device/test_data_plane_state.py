"""The data plane's device state against a plain SimDriver, the test thread playing the worker: memory
kinds (IPC pools, legacy fallback), host buffers and their limits, stream-ordered batches."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from cuctxd.daemon.backends.sim import SimDriver
from cuctxd.daemon.device.entries import DeviceLimits
from cuctxd.daemon.device.pools import IPC_GRANULARITY
from cuctxd.daemon.device.state import DeviceState
from cuctxd.daemon.registry.fd_budget import FdBudget, FdPlan
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.errors import BadArgument, CudaError, LimitExceeded, NotShareable, TooLarge, UnknownHandle
from cuctxd.protos.limits import MAX_STREAM_ORDERED_ENTRIES, MIN_CLIENT_HANDLE, POOL_BUFFER_MAX, STREAM_ORDERED_ENTRY
from tests.unit.daemon.device.test_device_state import new_ref, run

MEMORY = 1 << 24
ENTRY = struct.Struct(STREAM_ORDERED_ENTRY)


def make_state(ipc_pools: bool = True, memory: int = MEMORY, vmm: bool = True, **limits: Any) -> DeviceState:
    driver = SimDriver(device_count=1, memory_per_device=memory, ipc_pools=ipc_pools, vmm=vmm)
    driver.init()
    return DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=4096, **limits),
                       ShareRegistry(), TicketBook())


@pytest.fixture
def state() -> Iterator[DeviceState]:
    state = make_state()
    yield state
    state.tickets.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_small_shareable_buffer_is_one_vmm_allocation_of_the_granularity_holding_no_fd(state: DeviceState) -> None:
    ref, other = new_ref(), new_ref()
    granularity = state.driver.vmm_granularity(0)
    run(state, ref, "mem_get_info")  # binds the primary context, current on this thread from now on
    free, fds = state.driver.mem_get_info()[0], open_fds()
    buffers = [run(state, ref, "alloc", size=4096, shareable=True).result["buffer"] for _ in range(4)]
    assert state.driver.mem_get_info()[0] == free - 4 * granularity  # the device gives up 2 MiB each
    assert open_fds() == fds and not state.pools.own  # no pool, and no fd held for any of them
    assert state.sessions[ref.token].bytes_charged() == 4 * granularity  # the quota counts what the device gave
    run(state, ref, "write", (b"mine",), buffer=buffers[0]["handle"])
    share = run(state, ref, "export", buffer=buffers[0]["handle"]).result["share"]
    assert share["mechanism"] == "vmm" and share["allocation_size"] == granularity and share["size"] == 4096
    opened = run(state, other, "open_shared", share_id=share["share_id"], pool_fd=True).result
    assert state.sessions[other.token].bytes_charged() == granularity  # a hold costs the whole allocation too
    fds_given, _ = state.tickets.redeem(opened["ticket"], None)
    assert os.fstat(fds_given[0]).st_size == granularity  # this allocation and no other
    with mmap.mmap(fds_given[0], granularity) as mapped:
        assert mapped[:4] == b"mine"
    os.close(fds_given[0])
    run(state, other, "close_shared", share_id=share["share_id"])
    for buffer in buffers:
        run(state, ref, "free", buffer=buffer["handle"])
    assert state.driver.mem_get_info()[0] == free and state.sessions[ref.token].bytes_charged() == 0
    assert open_fds() == fds and not state.memory.vmm_memory.sizes


def test_a_session_quota_charges_a_4_kib_shareable_buffer_its_2_mib_allocation() -> None:
    granularity = 2 << 20
    state = make_state(session_quota=3 * granularity + 4096)
    ref = new_ref()
    for _ in range(3):
        run(state, ref, "alloc", size=4096, shareable=True)
    with pytest.raises(CudaError, match="session quota") as refused:
        run(state, ref, "alloc", size=4096, shareable=True)
    assert f"asked to allocate {granularity} more" in str(refused.value)
    run(state, ref, "alloc", size=4096)  # a private pool buffer is charged its size: the 4 KiB left fit it
    assert state.sessions[ref.token].bytes_charged() == 3 * granularity + 4096


def test_the_sims_memfd_of_an_exported_vmm_buffer_counts_in_its_owners_fd_budget() -> None:
    budget = FdBudget(FdPlan.derive(1024))  # 48 fds a session
    driver = SimDriver(device_count=1, memory_per_device=64 * (2 << 20))
    driver.init()
    state = DeviceState(driver, 0, driver.device_info(0), DeviceLimits(max_payload=4096), ShareRegistry(),
                        TicketBook(budget=budget))
    owner, opener = new_ref(), new_ref()
    buffers = [run(state, owner, "alloc", size=4096, shareable=True).result["buffer"] for _ in range(30)]
    assert budget.held == 0  # allocated, never exported: no fd
    opened = 0
    with pytest.raises(LimitExceeded, match=r"max_client_fds_per_session: .* exported VMM allocation"):
        for buffer in buffers:
            share = run(state, owner, "export", buffer=buffer["handle"]).result["share"]
            for _ in range(2):  # the second open of a buffer costs the owner nothing more
                ticket = run(state, opener, "open_shared", share_id=share["share_id"], pool_fd=True).result["ticket"]
                for fd in state.tickets.redeem(ticket, None)[0]:
                    os.close(fd)
            opened += 1
    assert opened == budget.per_session // driver.vmm_export_fds and budget.held == budget.per_session
    for buffer in buffers:
        run(state, owner, "free", buffer=buffer["handle"])
    state.close_session(opener)
    assert budget.held == 0
    state.tickets.close()


def test_without_vmm_a_shareable_buffer_has_a_pool_of_its_own() -> None:
    state = make_state(vmm=False)
    ref = new_ref()
    private = run(state, ref, "alloc", size=4096).result["buffer"]
    assert not private["shareable"]
    with pytest.raises(NotShareable, match="shareable=True"):
        run(state, ref, "export", buffer=private["handle"])
    buffer = run(state, ref, "alloc", size=4096, shareable=True).result["buffer"]
    assert buffer["shareable"]
    share = run(state, ref, "export", buffer=buffer["handle"]).result["share"]
    assert share["mechanism"] == "pool" and len(share["export_data"]) == 64 and share["ipc_handle"] == b""
    other = new_ref()
    opened = run(state, other, "open_shared", share_id=share["share_id"], pool_fd=True).result
    fds, info = state.tickets.redeem(opened["ticket"], None)
    assert info["pool_id"] == share["pool_id"] and len(fds) == 1
    assert os.fstat(fds[0]).st_size == IPC_GRANULARITY  # the pool holds this buffer and nothing else
    os.close(fds[0])
    assert "ticket" not in run(state, other, "open_shared", share_id=share["share_id"]).result
    second = run(state, ref, "alloc", size=4096, shareable=True).result["buffer"]
    assert run(state, ref, "export", buffer=second["handle"]).result["share"]["pool_id"] != share["pool_id"]
    state.tickets.close()


def exported_and_opened(state: DeviceState, owner: Any, holder: Any, data: bytes) -> tuple[Any, Any, int]:
    """A 100-byte shareable buffer of ``owner`` (less than a page) holding ``data``, exported and opened by
    ``holder`` with its fd (its pool's, or its VMM allocation's): the buffer, the share, and the fd (the caller's)."""
    buffer = run(state, owner, "alloc", size=100, shareable=True).result["buffer"]
    run(state, owner, "write", (data,), buffer=buffer["handle"])
    share = run(state, owner, "export", buffer=buffer["handle"]).result["share"]
    opened = run(state, holder, "open_shared", share_id=share["share_id"], pool_fd=True).result
    fds, _ = state.tickets.redeem(opened["ticket"], None)
    return buffer, share, fds[0]


def test_private_pools_are_per_uid_and_shared_pool_memory_is_scrubbed_before_its_free() -> None:
    state = make_state(vmm=False)
    alice, bob = new_ref(uid=1001), new_ref(uid=1002)
    run(state, alice, "alloc", size=4096)
    run(state, bob, "alloc", size=4096)
    assert len(state.pools.entries) == 2 and not state.pools.own
    buffer, share, fd = exported_and_opened(state, alice, bob, b"secret")
    with mmap.mmap(fd, 0) as pool:
        os.close(fd)
        assert pool[:6] == b"secret"
        run(state, alice, "free", buffer=buffer["handle"])
        run(state, bob, "close_shared", share_id=share["share_id"])
        assert not state.pools.own and pool[:IPC_GRANULARITY].count(0) == IPC_GRANULARITY
    state.tickets.close()


def test_once_stopping_a_share_nobody_keeps_is_neither_scrubbed_nor_freed(state: DeviceState) -> None:
    alice, bob = new_ref(uid=1001), new_ref(uid=1002)
    _, share, fd = exported_and_opened(state, alice, bob, b"weights")
    with mmap.mmap(fd, 0) as memory:
        os.close(fd)
        state.sharing.stop()
        state.close_session(alice)
        state.close_session(bob)
        assert memory[:7] == b"weights", "the stop wrote over memory a process maps"
        assert share["share_id"] in state.sharing.shares and state.memory.vmm_memory.sizes
        left = state.sharing.left_at_stop()
        assert left is not None and "1 shared buffer(s), 100 bytes" in left and "(1 held open" in left


def test_without_vmm_nor_ipc_pools_shareable_buffers_fall_back_to_legacy_ipc() -> None:
    state = make_state(ipc_pools=False, vmm=False)
    ref = new_ref()
    private = run(state, ref, "alloc", size=4096).result["buffer"]
    assert not private["shareable"]
    with pytest.raises(NotShareable, match="shareable=True"):
        run(state, ref, "export", buffer=private["handle"])
    legacy = run(state, ref, "alloc", size=4096, shareable=True).result["buffer"]
    share = run(state, ref, "export", buffer=legacy["handle"]).result["share"]
    assert share["mechanism"] == "ipc" and len(share["ipc_handle"]) == 64
    run(state, ref, "free", buffer=legacy["handle"])


def test_buffers_above_the_pool_maximum_are_legacy_allocations_shared_by_ipc_handle() -> None:
    state = make_state(memory=4 * POOL_BUFFER_MAX)
    ref = new_ref()
    largest = run(state, ref, "alloc", size=POOL_BUFFER_MAX, shareable=True).result["buffer"]
    above = run(state, ref, "alloc", size=POOL_BUFFER_MAX + 1).result["buffer"]
    assert run(state, ref, "export", buffer=largest["handle"]).result["share"]["mechanism"] == "vmm"
    share = run(state, ref, "export", buffer=above["handle"]).result["share"]
    assert above["shareable"] and share["mechanism"] == "ipc" and len(share["ipc_handle"]) == 64
    assert "ticket" not in run(state, new_ref(), "open_shared", share_id=share["share_id"], pool_fd=True).result
    run(state, ref, "free", buffer=above["handle"])
    state.tickets.close()


@pytest.mark.parametrize("vmm", [True, False])
def test_shareable_buffers_above_the_pool_maximum_are_vmm_allocations_where_the_device_has_vmm(vmm: bool) -> None:
    state = make_state(memory=4 * POOL_BUFFER_MAX, vmm=vmm)
    ref, other = new_ref(), new_ref()
    size = POOL_BUFFER_MAX + 1
    buffer = run(state, ref, "alloc", size=size, shareable=True).result["buffer"]
    run(state, ref, "write", (b"tail!",), buffer=buffer["handle"], offset=size - 5)
    share = run(state, ref, "export", buffer=buffer["handle"]).result["share"]
    if not vmm:
        assert share["mechanism"] == "ipc" and len(share["ipc_handle"]) == 64
        return
    granularity = state.driver.vmm_granularity(0)
    assert share["mechanism"] == "vmm" and share["ipc_handle"] == b"" and share["export_data"] == b""
    assert share["allocation_size"] == -(-size // granularity) * granularity
    opened = run(state, other, "open_shared", share_id=share["share_id"], pool_fd=True).result
    fds, info = state.tickets.redeem(opened["ticket"], None)
    assert info == {"share_id": share["share_id"]} and len(fds) == 1
    assert os.fstat(fds[0]).st_size == share["allocation_size"]  # the fd reaches this allocation and no other
    with mmap.mmap(fds[0], share["allocation_size"]) as mapped:
        assert mapped[size - 5:size] == b"tail!"
    os.close(fds[0])
    free = state.driver.mem_get_info()[0]
    run(state, ref, "free", buffer=buffer["handle"])
    run(state, other, "close_shared", share_id=share["share_id"])
    assert state.driver.mem_get_info()[0] == free + share["allocation_size"]
    assert not state.memory.vmm_memory.sizes
    state.tickets.close()


def test_shared_pool_memory_is_freed_only_after_its_last_holder(state: DeviceState) -> None:
    owner, holder = new_ref(), new_ref()
    buffer = run(state, owner, "alloc", size=1 << 20, shareable=True).result["buffer"]
    share = run(state, owner, "export", buffer=buffer["handle"]).result["share"]
    run(state, holder, "open_shared", share_id=share["share_id"])
    run(state, owner, "free", buffer=buffer["handle"])
    assert share["share_id"] in state.sharing.shares
    run(state, holder, "close_shared", share_id=share["share_id"])
    assert share["share_id"] not in state.sharing.shares


def test_host_buffer_copies_both_ways(state: DeviceState) -> None:
    ref = new_ref()
    host = run(state, ref, "host_alloc", size=8192).result
    fds, _ = state.tickets.redeem(host["ticket"], None)
    os.close(fds[0])
    entry = state.session(ref).host_buffers[host["host"]]
    entry.view[:5] = b"hello"
    buffer = run(state, ref, "alloc", size=8192).result["buffer"]
    assert run(state, ref, "memcpy_htod", buffer=buffer["handle"], host=host["host"]).result["size"] == 8192
    entry.view[:5] = b"\0" * 5
    run(state, ref, "memcpy_dtoh", buffer=buffer["handle"], host=host["host"], size=5, host_offset=100)
    assert bytes(entry.view[100:105]) == b"hello"
    run(state, ref, "host_free", host=host["host"])
    assert state.session(ref).host_bytes == 0 and state.host.total_bytes == 0
    with pytest.raises(UnknownHandle):
        run(state, ref, "host_free", host=host["host"])


def test_host_memory_limits_per_session_and_device() -> None:
    state = make_state(host_memory_per_session=1 << 20, max_host_memory=(1 << 20) + 4096)
    first, second = new_ref(), new_ref()
    run(state, first, "host_alloc", size=1 << 20)
    with pytest.raises(LimitExceeded, match="host_memory_per_session"):
        run(state, first, "host_alloc", size=4096)
    run(state, second, "host_alloc", size=4096)
    with pytest.raises(LimitExceeded, match="max_host_memory"):
        run(state, second, "host_alloc", size=4096)
    state.close_session(first)
    assert state.host.total_bytes == 4096
    state.tickets.close()


def test_a_host_buffer_made_in_a_created_context_outlives_it(state: DeviceState) -> None:
    """The client's staging ring is made in whatever context is current: destroying that context must not
    take it (it is registered in the session's primary, portable, and serves every context)."""
    ref = new_ref()
    context = run(state, ref, "create_context").result["context"]
    host = run(state, ref, "host_alloc", size=4096).result["host"]
    assert [c["handle"] for c in run(state, ref, "context_stack").result["stack"]] == [context["handle"]]
    run(state, ref, "destroy_context", context=context["handle"])
    assert state.session(ref).host_bytes == 4096
    run(state, ref, "set_device")
    buffer = run(state, ref, "alloc", size=4096).result["buffer"]
    assert run(state, ref, "memcpy_htod", buffer=buffer["handle"], host=host).result == {"size": 4096}
    state.close_session(ref)
    assert state.host.total_bytes == 0


def _entries(*entries: tuple[int, int, int]) -> bytes:
    return b"".join(ENTRY.pack(*entry) for entry in entries)


def test_stream_ordered_runs_entries_in_order_and_defers_failures(state: DeviceState) -> None:
    ref = new_ref()
    a, b, huge = MIN_CLIENT_HANDLE, MIN_CLIENT_HANDLE + 1, MIN_CLIENT_HANDLE + 2
    reply = run(state, ref, "stream_ordered", ops=_entries((1, a, 4096), (1, b, 4096), (2, a, 0), (1, huge, 1 << 40)))
    assert reply.result == {"done": 3, "failed": 1}
    session = state.session(ref)
    assert set(session.buffers) == {b}
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        run(state, ref, "fill", buffer=huge)
    with pytest.raises(UnknownHandle):
        run(state, ref, "fill", buffer=huge)
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        run(state, ref, "synchronize")


def test_stream_ordered_refuses_daemon_range_handles_and_reused_ones(state: DeviceState) -> None:
    ref = new_ref()
    reply = run(state, ref, "stream_ordered", ops=_entries((1, 5, 4096), (1, MIN_CLIENT_HANDLE, 16),
                                                           (1, MIN_CLIENT_HANDLE, 16), (9, MIN_CLIENT_HANDLE, 0)))
    assert reply.result == {"done": 1, "failed": 3}
    with pytest.raises(BadArgument):
        run(state, ref, "synchronize")


def test_stream_ordered_bounds_its_batch(state: DeviceState) -> None:
    ref = new_ref()
    with pytest.raises(BadArgument, match="whole"):
        run(state, ref, "stream_ordered", ops=b"x" * 10)
    with pytest.raises(TooLarge):
        run(state, ref, "stream_ordered", ops=_entries(*[(2, MIN_CLIENT_HANDLE, 0)] * (MAX_STREAM_ORDERED_ENTRIES + 1)))
