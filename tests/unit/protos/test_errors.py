"""The client-side errors are also the standard library's: code that handles timeouts, lost connections or
missing attributes in general handles cuctxd's, and the cuctxd name, code and op stay on them."""

from __future__ import annotations

import pytest

from cuctxd.protos.errors import (
    ConnectionLost,
    CuctxError,
    DaemonRestarted,
    DaemonTimeout,
    NoDaemon,
    WrongBackend,
)


@pytest.mark.parametrize(("error", "standard"), [
    (DaemonTimeout("no reply from ipc:///x within 1 s", "alloc"), TimeoutError),
    (ConnectionLost("the client is closed", "alloc"), ConnectionError),
    (NoDaemon("no cuctxd is listening at ipc:///x", "alloc"), ConnectionError),
    (DaemonRestarted("another cuctxd listens at ipc:///x", "alloc"), ConnectionError),
    (WrongBackend("a sim share has no ptr"), AttributeError),
])
def test_client_side_errors_are_the_standard_ones_too(error: CuctxError, standard: type[Exception]) -> None:
    assert isinstance(error, standard) and isinstance(error, CuctxError)
    with pytest.raises(standard) as caught:
        raise error
    assert caught.value is error


def test_they_keep_their_name_code_message_and_op() -> None:
    timeout = DaemonTimeout("no reply from ipc:///x within 1 s", "alloc")
    assert (timeout.code, timeout.name, timeout.op) == (0, "CUCTXD_TIMEOUT", "alloc")
    assert timeout.message == "no reply from ipc:///x within 1 s"
    assert str(timeout).startswith("alloc: CUCTXD_TIMEOUT") and "within 1 s" in str(timeout)
    assert timeout.errno is None  # not an OS error: no errno to look at
    lost = NoDaemon("no cuctxd is listening at ipc:///x", "hello")
    assert (lost.name, lost.op, lost.message) == ("CUCTXD_NO_DAEMON", "hello", "no cuctxd is listening at ipc:///x")


def test_a_timeout_is_not_a_lost_connection_nor_the_other_way_round() -> None:
    assert not isinstance(DaemonTimeout("t"), ConnectionError)
    assert not isinstance(ConnectionLost("c"), TimeoutError)
