"""Which VMM mappings a process keeps after their last opening closes (client/data_plane/vmm_imports.py): a
versioned name's buffers while the daemon lists them and the process holds a version or publishes; at most
KEPT_PER_NAME per name; none of a plain share. Sim mappings of real memfds, no daemon."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from cuctxd.client.data_plane.vmm_imports import KEPT_PER_NAME, VmmImports
from cuctxd.protos.records import ShareDescriptor

SIZE = 2 << 20


def _descriptor(buffer_id: str, version: int = 1, buffers: tuple[str, ...] = ()) -> ShareDescriptor:
    return ShareDescriptor(share_id="s-" + buffer_id, device=0, device_uuid="u", size=SIZE, backend="sim",
                           ipc_handle=b"", host="h", mechanism="vmm", allocation_size=SIZE, name="policy" if version
                           else None, version=version, buffer_id=buffer_id, buffers=buffers)


def _fd() -> int:
    fd = os.memfd_create("vmm-kept-test")
    os.ftruncate(fd, SIZE)
    return fd


class _Publisher:
    """A client as the table sees one: whether its session is open."""

    has_session = True


@pytest.fixture
def imports() -> VmmImports:
    return VmmImports()


def test_a_plain_share_is_unmapped_with_its_last_opening(imports: VmmImports) -> None:
    imports.map(_descriptor("plain", version=0), _fd()).close()
    assert imports.kept("policy") == 0 and imports.reuse(_descriptor("plain", version=0)) is None


def test_a_versioned_buffer_is_kept_while_listed_and_a_version_is_held(imports: VmmImports) -> None:
    both = ("b1", "b2")
    one = imports.map(_descriptor("b1", 1, both), _fd())
    two = imports.map(_descriptor("b2", 2, both), _fd())
    one.close()  # version 2 is held: b1 (the name's spare next) stays mapped
    assert imports.kept("policy") == 1
    again = imports.reuse(_descriptor("b1", 3, ("b2", "b1")))  # version 3 went into b1: no fd, no map
    assert again is not None and imports.imported == 2 and imports.reused == 1
    again.close()
    assert imports.kept("policy") == 1
    imports.told("policy", ("b2",))  # a reply without b1 (the daemon released it): its kept mapping goes
    assert imports.kept("policy") == 0 and imports.lease("b1") is None
    two.close()


def test_the_last_version_closed_drops_every_kept_mapping(imports: VmmImports) -> None:
    both = ("b1", "b2")
    one, two = imports.map(_descriptor("b1", 1, both), _fd()), imports.map(_descriptor("b2", 2, both), _fd())
    one.close()
    assert imports.kept("policy") == 1
    two.close()  # no version of the name is open here, and this process publishes none
    assert imports.kept("policy") == 0


def test_a_publisher_keeps_its_buffers_until_its_client_closes(imports: VmmImports) -> None:
    trainer = _Publisher()
    imports.publishing(trainer, "policy", ("b1",))
    imports.map(replace(_descriptor("b1", 0), name=None), _fd()).close()  # its mapping of the new buffer, unnamed
    assert imports.kept("policy") == 1
    leased = imports.lease("b1")
    assert leased is not None and leased[1] == "u"
    leased[0].close()
    imports.closed(trainer)
    assert imports.kept("policy") == 0 and imports.lease("b1") is None


def test_at_most_kept_per_name_the_least_recently_used_going_first(imports: VmmImports) -> None:
    ids = tuple(f"b{i}" for i in range(KEPT_PER_NAME + 2))
    held = imports.map(_descriptor(ids[-1], 9, ids), _fd())  # a version held: the others may be kept
    for index, buffer_id in enumerate(ids[:-1]):
        imports.map(_descriptor(buffer_id, index + 1, ids), _fd()).close()
    assert imports.kept("policy") == KEPT_PER_NAME
    assert imports.lease(ids[0]) is None  # the oldest went
    held.close()
