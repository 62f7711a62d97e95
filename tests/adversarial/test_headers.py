"""Reply headers stay under MAX_HEADER_BYTES however many objects a client makes.

Clients discard a header above ``MAX_HEADER_BYTES``, so a reply that outgrows it
looks like no reply at all. Arrays that grow with what clients make are cut at
``MAX_LISTED`` entries with the full count and ``truncated: true`` beside them,
``status`` lists fewer where its size demands, and the encoder answers
``CUCTXD_ERROR_TOO_LARGE`` rather than send an oversize header.
"""

from __future__ import annotations

import time

import msgpack
import pytest

from cuctxd.protos.errors import TooLarge
from cuctxd.protos.limits import MAX_HEADER_BYTES, MAX_LISTED
from cuctxd.protos.messages import encode_result
from cuctxd.protos.version import PROTOCOL_VERSION
from tests.adversarial.attacks import Bystander, call_many, rss_bytes, scaled
from tests.helpers import DaemonProcess
from tests.helpers_raw import raw_peer

#: Contexts one session makes: more than MAX_LISTED, so status and context_stack must cut.
CONTEXTS = scaled(MAX_LISTED + 500)
#: Names on one share, each as long as a name may be: together far over MAX_HEADER_BYTES.
NAMES = scaled(4500)
#: Most bytes the daemon's RSS may grow by under this attack (objects, not payloads).
RSS_GROWTH_CEILING = 200 * 1024 * 1024


def header_size(peer_reply: dict[str, object]) -> int:
    return len(msgpack.packb(peer_reply, use_bin_type=True))


@pytest.fixture
def attack_daemon_args() -> tuple[str, ...]:
    return ("--max-objects-per-session", "0", "--max-contexts-per-session", "0")


def test_thousands_of_contexts_are_listed_up_to_the_cap_with_counts(attack_daemon: DaemonProcess,
                                                                   bystander: Bystander) -> None:
    rss_before = rss_bytes(attack_daemon.process.pid)
    with raw_peer(attack_daemon.endpoint) as peer:
        session = peer.hello()
        created = call_many(peer, "create_context", [{"device": 0}] * CONTEXTS, session)
        bystander.check()

        header, _ = peer.call("context_stack", {"device": 0}, session)
        stack = header["result"]
        assert header_size(header) <= MAX_HEADER_BYTES
        assert stack["depth"] == CONTEXTS and stack["truncated"] is True
        assert len(stack["stack"]) == MAX_LISTED
        assert stack["stack"][-1]["handle"] == created[-1]["context"]["handle"], "the top must be listed"

        header, _ = peer.call("status", None, session)
        assert header["ok"] is True and header_size(header) <= MAX_HEADER_BYTES
        status = header["result"]
        device = status["devices"][0]
        assert status["truncated"] is True and device["truncated"] is True
        assert device["context_count"] >= CONTEXTS and len(device["contexts"]) == MAX_LISTED
        assert status["devices"][1]["truncated"] is False
    assert rss_bytes(attack_daemon.process.pid) - rss_before < RSS_GROWTH_CEILING


def test_thousands_of_long_names_keep_status_and_list_shared_under_the_header_limit(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    with raw_peer(attack_daemon.endpoint) as peer:
        session = peer.hello()
        buffer, _ = peer.ok("alloc", {"size": 4096, "device": 1, "shareable": True}, session)
        handle = buffer["buffer"]["handle"]
        names = [f"{i:06d}-" + "n" * 249 for i in range(NAMES)]
        started = time.monotonic()
        call_many(peer, "publish", [{"buffer": handle, "name": name, "device": 1} for name in names], session)
        bystander.check()

        header, _ = peer.call("list_shared", None, session)
        assert header["ok"] is True and header_size(header) <= MAX_HEADER_BYTES
        shared = header["result"]
        assert shared["count"] == NAMES and shared["truncated"] is True
        assert [entry["name"] for entry in shared["shared"]] == names[:MAX_LISTED]

        header, _ = peer.call("status", None, session)
        assert header["ok"] is True, header
        assert header_size(header) <= MAX_HEADER_BYTES
        status = header["result"]
        share = status["devices"][1]["shares"][0]
        assert status["truncated"] is True and status["devices"][1]["truncated"] is True
        assert 0 < len(share["names"]) < NAMES and share["names"] == sorted(names)[:len(share["names"])]
        assert status["devices"][1]["share_count"] == 1
    assert time.monotonic() - started < 120


def test_a_page_of_names_whose_records_would_not_fit_a_header_is_cut_and_says_where_to_go_on(
        attack_daemon: DaemonProcess, bystander: Bystander) -> None:
    """A publisher's client name may be 4096 characters, and every record of its names repeats it: a full page of
    them (over 4 MiB) used to answer TOO_LARGE. Now the page stops short with ``next``, and paging lists all."""
    with raw_peer(attack_daemon.endpoint) as peer:
        session = peer.ok("hello", {"protocol": PROTOCOL_VERSION, "client": "c" * 4096, "pid": 1})[0]["session"]
        buffer, _ = peer.ok("alloc", {"size": 4096, "device": 0, "shareable": True}, session)
        handle = buffer["buffer"]["handle"]
        names = [f"long-{i:04d}-" + "n" * 240 for i in range(MAX_LISTED)]
        call_many(peer, "publish", [{"buffer": handle, "name": name, "device": 0} for name in names], session)
        listed: list[str] = []
        args: dict[str, object] = {"prefix": "long-"}
        pages = 0
        while True:
            header, _ = peer.call("list_shared", args, session)
            assert header["ok"] is True and header_size(header) <= MAX_HEADER_BYTES, header.get("error")
            page = header["result"]
            listed += [entry["name"] for entry in page["shared"]]
            pages += 1
            if page["next"] is None:
                break
            assert page["truncated"] is True and page["next"] == listed[-1]
            args["after"] = page["next"]
        assert listed == names and pages > 2
        peer.ok("free", {"buffer": handle, "device": 0}, session)
        bystander.check()


def test_the_encoder_answers_too_large_instead_of_an_oversize_header() -> None:
    header = msgpack.unpackb(encode_result(7, {"blob": "x" * MAX_HEADER_BYTES}), raw=False)
    assert header["id"] == 7 and header["ok"] is False
    assert header["error"]["name"] == TooLarge.code_enum.name
    assert "MAX_HEADER_BYTES" in header["error"]["message"]
    fits = encode_result(8, {"blob": "x" * (MAX_HEADER_BYTES - 64)})
    assert len(fits) <= MAX_HEADER_BYTES and msgpack.unpackb(fits, raw=False)["ok"] is True
