"""The fd channel's ticket book on its own: one use, the peer's uid, expiry and bounds, and that every
fd it gives up is closed."""

from __future__ import annotations

import os

import pytest

from cuctxd.daemon.registry.fd_budget import FdBudget, FdPlan
from cuctxd.daemon.registry.tickets import TicketBook, TicketLimits
from cuctxd.protos.errors import LimitExceeded, NotFound


def pipe_fd() -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_ticket_redeems_once_for_its_user() -> None:
    book = TicketBook()
    fd = pipe_fd()
    ticket = book.issue("s1", 1000, [fd], {"host": 7})
    with pytest.raises(NotFound):
        book.redeem(ticket, 1001)  # another user: refused, and the ticket is void
    assert not is_open(fd)
    with pytest.raises(NotFound):
        book.redeem(ticket, 1000)
    fd = pipe_fd()
    ticket = book.issue("s1", 1000, [fd], {"host": 7})
    fds, info = book.redeem(ticket, 1000)
    assert fds == [fd] and info == {"host": 7} and is_open(fd)
    os.close(fd)
    with pytest.raises(NotFound):
        book.redeem(ticket, 1000)  # a replay


def test_a_wrong_secret_for_a_real_id_is_refused_like_an_unknown_ticket() -> None:
    book = TicketBook()
    fd = pipe_fd()
    ticket = book.issue("s", None, [fd], {})
    forged = ticket[:16] + "0" * 64
    with pytest.raises(NotFound) as wrong:
        book.redeem(forged, None)
    with pytest.raises(NotFound) as unknown:
        book.redeem("f" * 80, None)
    assert wrong.value.message == unknown.value.message
    assert book.stats() == {"tickets": 0, "fds": 0} and not is_open(fd)


def test_expired_and_dropped_tickets_close_their_fds() -> None:
    book = TicketBook(TicketLimits(fd_ticket_ttl=0.0))
    late = pipe_fd()
    book.issue("s", None, [late], {})
    assert book.expire() == 1 and not is_open(late)
    book = TicketBook()
    mine, theirs = pipe_fd(), pipe_fd()
    book.issue("ending", None, [mine], {})
    kept = book.issue("other", None, [theirs], {})
    book.drop_session("ending")
    assert not is_open(mine) and is_open(theirs)
    fds, _ = book.redeem(kept, None)
    os.close(fds[0])


def test_bounds_per_session_and_in_all_close_what_they_refuse() -> None:
    budget = FdBudget(FdPlan(0, 0, 0, client_fds=3, per_peer=3, per_session=3))
    book = TicketBook(TicketLimits(max_tickets_per_session=2), budget=budget)
    for _ in range(2):
        book.issue("a", None, [pipe_fd()], {})
    refused = pipe_fd()
    with pytest.raises(LimitExceeded, match="max_tickets_per_session"):
        book.issue("a", None, [refused], {})
    assert not is_open(refused)
    book.issue("b", None, [pipe_fd()], {})
    refused = pipe_fd()
    with pytest.raises(LimitExceeded, match=r"\): max_client_fds: "):
        book.issue("c", None, [refused], {})
    assert not is_open(refused)
    book.close()
    assert book.stats() == {"tickets": 0, "fds": 0}
