"""When a client polls for its shm lane's reply without sleeping: while replies come within the window."""

from __future__ import annotations

from cuctxd.client.wire.shm_lane import BusyPoll


def test_a_lane_polls_busily_while_replies_come_within_the_window() -> None:
    poll = BusyPoll(200e-6)
    assert poll.worth_it()  # nothing seen yet: try
    for _ in range(10):
        poll.observe(50e-6)
    assert poll.worth_it()


def test_slow_replies_send_it_to_sleep_and_fast_ones_bring_it_back() -> None:
    poll = BusyPoll(200e-6)
    for _ in range(4):
        poll.observe(900e-6)  # a device busy with other sessions' work
    assert not poll.worth_it()
    for _ in range(12):
        poll.observe(40e-6)
    assert poll.worth_it()


def test_one_slow_reply_among_fast_ones_does_not_stop_it() -> None:
    poll = BusyPoll(200e-6)
    for _ in range(10):
        poll.observe(40e-6)
    poll.observe(400e-6)
    assert poll.worth_it()


def test_a_window_of_zero_never_polls() -> None:
    poll = BusyPoll(0.0)
    assert not poll.worth_it()


def test_one_long_synchronize_stops_polling_for_two_replies_at_most() -> None:
    poll = BusyPoll(200e-6)
    poll.observe(30.0)  # a synchronize that waited half a minute
    assert not poll.worth_it()
    poll.observe(40e-6)
    poll.observe(40e-6)
    assert poll.worth_it()
