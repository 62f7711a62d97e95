"""Spares of versioned names in the share index (ShareRegistry with its VersionBook): which allocation is a name's
spare, who may take it back for the next version, and the ``buffers`` replies about the name carry."""

from __future__ import annotations

from dataclasses import replace

from cuctxd.daemon.registry.names import Naming
from cuctxd.daemon.registry.sessions import SessionRef
from cuctxd.daemon.registry.shares import ShareRegistry
from cuctxd.daemon.registry.versions import Spare
from tests.unit.daemon.registry.plain_shares import PlainShare

TRAINER = SessionRef("t1", 1, "trainer", 1, uid=7)
#: A later run of the same trainer (same uid): may publish the name's next version.
NEXT_RUN = SessionRef("t2", 2, "trainer", 2, uid=7)
STRANGER = SessionRef("s1", 3, "other", 3, uid=8)


def _version(registry: ShareRegistry, share_id: str, buffer_id: str) -> PlainShare:
    share = PlainShare(share_id, TRAINER)
    share.descriptor = replace(share.descriptor, buffer_id=buffer_id)
    registry.add(share)
    registry.publish("policy", share, Naming(b"m", 1), version=True)
    return share


def _spare(buffer_id: str, size: int = 4096, device: int = 0) -> Spare:
    return Spare(buffer_id, device, size, TRAINER)


def _with_spare() -> ShareRegistry:
    """Versions 1 (share s1, buffer b1) and 2 (s2, b2) of "policy", version 1 freed: b1 is the spare."""
    registry = ShareRegistry()
    one = _version(registry, "s1", "b1")
    _version(registry, "s2", "b2")
    assert registry.keep_spare("policy", _spare("b1"), "s1")
    registry.remove(one)
    return registry


def test_a_freed_version_is_kept_as_the_spare_only_while_its_name_has_a_live_version() -> None:
    registry = ShareRegistry()
    one, two = _version(registry, "s1", "b1"), _version(registry, "s2", "b2")
    assert registry.buffers("policy") == ("b1", "b2")
    assert registry.keep_spare("policy", _spare("b1"), "s1")  # nobody holds version 1 any more
    registry.remove(one)
    assert registry.buffers("policy") == ("b2", "b1")  # the live version's, then the spare's
    assert registry.lookup("policy").buffers == ("b2", "b1")
    assert registry.buffers_of_share("s2") == ("b2", "b1")
    assert not registry.keep_spare("policy", _spare("b9"), "s9")  # at most one spare a name: b9 is released
    registry.remove(two)  # its last live version went: the spare is no longer the name's
    assert not registry.is_spare("policy", "b1")
    assert registry.buffers("policy") == ()
    assert not registry.keep_spare("policy", _spare("b2"), "s2")


def test_a_names_last_version_is_never_kept_as_its_spare() -> None:
    registry = ShareRegistry()
    _version(registry, "s1", "b1")
    assert not registry.keep_spare("policy", _spare("b1"), "s1")  # it would be the name's only buffer, held by none


def test_the_spare_goes_back_only_to_a_session_that_may_publish_the_next_version_and_only_where_it_fits() -> None:
    registry = _with_spare()
    assert registry.claim_spare("policy", STRANGER, 0, 4096) == (None, False)  # another uid: not its bytes to see
    assert registry.is_spare("policy", "b1")
    assert registry.claim_spare("policy", NEXT_RUN, 0, 4096) == (_spare("b1"), False)
    assert not registry.is_spare("policy", "b1") and registry.buffers("policy") == ("b2",)
    assert registry.claim_spare("policy", NEXT_RUN, 0, 4096) == (None, False)  # taken once


def test_a_next_version_of_another_size_or_device_drops_the_spare() -> None:
    registry = _with_spare()
    assert registry.claim_spare("policy", TRAINER, 0, 8192) == (None, True)  # released by its worker
    assert not registry.is_spare("policy", "b1")
    assert registry.keep_spare("policy", _spare("b1"), "s1")
    assert registry.claim_spare("policy", TRAINER, 1, 4096) == (None, True)


def test_dropping_a_spare_names_its_buffer() -> None:
    registry = _with_spare()
    registry.drop_spare("policy", "b7")  # not its spare: nothing changes
    assert registry.is_spare("policy", "b1")
    registry.drop_spare("policy", "b1")
    assert registry.buffers("policy") == ("b2",)
