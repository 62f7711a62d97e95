"""Scoped share names and who may publish them (ShareRegistry's check_scope); peer uids from ipc peers."""

from __future__ import annotations

import os
import pwd

import pytest

from cuctxd.daemon.intake.peers import uid_of
from cuctxd.daemon.registry.shares import check_scope
from cuctxd.protos.errors import NotOwner


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
