"""The open-file limit's split (FdPlan) and the budget of fds held for clients (FdBudget): its shares, its
refusals naming the limit, and charges given back once."""

from __future__ import annotations

import os
import threading

import pytest

from cuctxd.daemon.registry.fd_budget import FdBudget, FdLimits, FdPlan, fd_peer, fd_reserve
from cuctxd.daemon.registry.tickets import TicketBook
from cuctxd.protos.errors import LimitExceeded


@pytest.mark.parametrize("files", [64, 256, 1024, 4096, 1 << 20])
def test_the_plan_never_passes_the_open_file_limit(files: int) -> None:
    plan = FdPlan.derive(files)
    assert plan.reserve == fd_reserve(files)
    assert plan.reserve + plan.connections + plan.client_fds == files
    assert 0 < plan.per_session <= plan.per_peer < plan.client_fds


def test_the_plan_at_1024_open_files() -> None:
    assert FdPlan.derive(1024) == FdPlan(open_files=1024, reserve=256, connections=384, client_fds=384,
                                         per_peer=96, per_session=48)


def test_configured_values_are_kept_or_lowered_to_what_the_limit_allows() -> None:
    plan = FdPlan.derive(1024, FdLimits(max_connections=100, max_client_fds=200, max_client_fds_per_peer=50,
                                         max_client_fds_per_session=10))
    assert (plan.connections, plan.client_fds, plan.per_peer, plan.per_session) == (100, 200, 50, 10)
    plan = FdPlan.derive(1024, FdLimits(max_connections=5000, max_client_fds=5000, max_client_fds_per_peer=5000,
                                         max_client_fds_per_session=5000))
    assert plan.connections == 576 and plan.client_fds == 192  # connections never take all the room
    assert plan.per_peer == plan.client_fds and plan.per_session == plan.per_peer
    assert plan.reserve + plan.connections + plan.client_fds == 1024


def test_a_peer_is_a_process_or_another_users_uid() -> None:
    assert fd_peer(os.getuid(), 42) == "process:42"
    assert fd_peer(os.getuid() + 1, 42) == f"uid:{os.getuid() + 1}"
    assert fd_peer(None, None, "address:10.0.0.1") == "address:10.0.0.1"


def budget(total: int = 10, per_peer: int = 6, per_session: int = 4) -> FdBudget:
    return FdBudget(FdPlan(open_files=0, reserve=0, connections=0, client_fds=total, per_peer=per_peer,
                           per_session=per_session))


def test_each_share_refuses_naming_its_limit_and_counts_nothing_then() -> None:
    fds = budget()
    fds.charge(4, "x", "p1", "s1")
    with pytest.raises(LimitExceeded, match=r"\): max_client_fds_per_session: "):
        fds.charge(1, "x", "p1", "s1")
    fds.charge(2, "x", "p1", "s2")
    with pytest.raises(LimitExceeded, match=r"\): max_client_fds_per_peer: .*p1"):
        fds.charge(1, "x", "p1", "s3")
    fds.charge(4, "x", "p2", "s4")
    with pytest.raises(LimitExceeded, match=r"\): max_client_fds: "):
        fds.charge(1, "x", "p3")
    status = fds.to_status()
    assert status["held"] == 10 and status["refused"] == 3 and status["peers"] == 2
    assert status["top_peers"][0] == {"peer": "p1", "held": 6}


def test_one_peer_at_its_share_leaves_room_for_another() -> None:
    fds = budget()
    for session in ("a", "b", "c"):
        with pytest.raises(LimitExceeded):
            while True:
                fds.charge(1, "x", "greedy", session)
    assert fds.held_by("greedy") == 6
    fds.charge(4, "x", "bystander", "d")


def test_a_charge_is_given_back_once() -> None:
    fds = budget()
    charge = fds.charge(3, "x", "p", "s")
    charge.release()
    charge.release()
    assert fds.held == 0 and fds.held_by("p") == 0
    assert fds.to_status()["top_peers"] == []


def test_threads_charging_and_releasing_leave_it_balanced() -> None:
    fds = FdBudget()

    def churn() -> None:
        for _ in range(2000):
            fds.charge(2, "x", "p", "s").release()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fds.held == 0


def test_tickets_count_their_fds_until_redeemed_or_dropped() -> None:
    fds = budget(total=3, per_peer=3, per_session=3)
    book = TicketBook(budget=fds)
    pipes = [os.pipe() for _ in range(3)]
    for _read_end, write_end in pipes:
        os.close(write_end)
    ticket = book.issue("s", None, [pipes[0][0], pipes[1][0]], {}, "p")
    assert fds.held_by("p") == 2
    refused_read, refused_write = os.pipe()
    os.close(refused_write)
    with pytest.raises(LimitExceeded, match="max_client_fds"):
        book.issue("s", None, [pipes[2][0], refused_read], {}, "p")
    with pytest.raises(OSError):
        os.fstat(refused_read)  # a refused ticket's fds are closed
    assert fds.held == 2
    got, _ = book.redeem(ticket, None)
    for fd in got:
        os.close(fd)
    assert fds.held == 0
    book.issue("s", None, [os.dup(0)], {}, "p")
    book.drop_session("s")
    assert fds.held == 0
