"""Scoped share names and who may publish them (ShareRegistry's check_scope); peer uids from ipc peers;
what names cost their session and uid (``max_manifest_bytes_per_*``)."""

from __future__ import annotations

import os
import pwd

import pytest

from cuctxd.daemon.intake.peers import uid_of
from cuctxd.daemon.registry.name_index import NameFilter
from cuctxd.daemon.registry.names import Naming, check_scope
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareLimits, ShareRegistry
from cuctxd.protos.errors import LimitExceeded, NameExists, NotOwner
from cuctxd.protos.limits import NAME_OVERHEAD_BYTES as EACH
from tests.unit.daemon.registry.plain_shares import PlainShare


def _someone_else() -> int:
    return max(entry.pw_uid for entry in pwd.getpwall()) + 1000


def test_a_scoped_name_is_refused_to_another_user() -> None:
    with pytest.raises(NotOwner, match="scoped to user 'root'"):
        check_scope("root/weights", _someone_else())


def test_a_scoped_name_is_refused_when_the_uid_is_unknown() -> None:
    with pytest.raises(NotOwner, match="cannot tell"):
        check_scope("root/weights", None)


def test_a_scoped_name_is_allowed_to_its_user_and_the_daemons() -> None:
    check_scope(f"{pwd.getpwuid(os.geteuid()).pw_name}/weights", os.geteuid())
    check_scope("nosuchuser-xyz/weights", os.geteuid())  # the daemon's own user may publish any scope


def test_an_unscoped_name_is_anyones() -> None:
    check_scope("weights", None)
    check_scope("weights", _someone_else())


def test_the_uid_comes_from_an_ipc_peer_only() -> None:
    assert uid_of("address:localhost:1000:1000:4242") == 1000
    assert uid_of("address:127.0.0.1") is None
    assert uid_of("key:abc") is None
    assert uid_of(None) is None


def test_names_are_charged_to_their_session_and_uid_until_they_go() -> None:
    """Each name costs its manifest, its own bytes and NAME_OVERHEAD_BYTES (EACH below)."""
    registry = ShareRegistry(ShareLimits(max_manifest_bytes_per_session=1000 + 2 * EACH,
                                         max_manifest_bytes_per_uid=1500 + 2 * EACH))
    first, second = SessionRef("t1", 1, "a", 1, uid=7), SessionRef("t2", 2, "b", 2, uid=7)
    shares = [PlainShare("s1", first), PlainShare("s2", second)]
    for share in shares:
        registry.add(share)
    registry.publish("a", shares[0], Naming(b"m" * 899))  # 900 bytes with its name, and EACH
    with pytest.raises(LimitExceeded, match=r"\): max_manifest_bytes_per_session: "):
        registry.publish("b", shares[0], Naming(b"m" * 100))
    registry.publish("c", shares[1], Naming(b"m" * 499))  # the uid's 1400 + 2 EACH of 1500 + 2 EACH
    with pytest.raises(LimitExceeded, match=r"\): max_manifest_bytes_per_uid: the sessions of uid 7"):
        registry.publish("d", shares[1], Naming(b"m" * 100))
    assert registry.names_status() == {"count": 2, "bytes": 1400 + 2 * EACH,
                                       "top_uids": [{"uid": 7, "bytes": 1400 + 2 * EACH, "names": 2}]}
    registry.unpublish("a", first)
    registry.publish("d", shares[1], Naming(b"m" * 100))
    registry.remove(shares[1])  # the share's end takes its names and gives their bytes back
    assert registry.names_status() == {"count": 0, "bytes": 0, "top_uids": []}


def test_replace_moves_a_name_in_one_step_for_whoever_may_unpublish_it() -> None:
    registry = ShareRegistry(ShareLimits(max_manifest_bytes_per_session=1000 + EACH,
                                         max_manifest_bytes_per_uid=1000 + EACH))
    first, again, stranger = (SessionRef("t1", 1, "a", 1, uid=7), SessionRef("t2", 2, "a", 2, uid=7),
                              SessionRef("t3", 3, "b", 3, uid=_someone_else()))
    old, new, theirs = PlainShare("s1", first), PlainShare("s2", again), PlainShare("s3", stranger)
    for share in (old, new, theirs):
        registry.add(share)
    registry.publish("model", old, Naming(b"m" * 895, 1, digest="xxh3-128:" + "0" * 32))
    with pytest.raises(NameExists, match="or publish with replace"):
        registry.publish("model", new, Naming(b"m" * 895))
    with pytest.raises(NotOwner, match="may replace it"):
        registry.publish("model", theirs, Naming(), replace=True)
    # the uid's bytes: the old name's 900 + EACH are given back as the new one's 900 + EACH are charged
    assert registry.publish("model", new, Naming(b"m" * 895, 1, digest="xxh3-128:" + "1" * 32), replace=True) \
        == [("s1", 0)]
    assert registry.lookup("model").share_id == "s2" and registry.names_status()["bytes"] == 900 + EACH
    assert [(s["name"], s["share_id"], s["digest"]) for s in registry.page(NameFilter(), 10)[0]] == [
        ("model", "s2", "xxh3-128:" + "1" * 32)]
    registry.drop_names(old)  # the old share still lists the name until its worker forgets it: not the new one's
    assert registry.lookup("model").share_id == "s2"
    assert registry.publish("model", new, Naming(), replace=True) == []  # its own name: nothing left behind
