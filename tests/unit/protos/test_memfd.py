"""Sealed memfds (PROTOCOL.md, "The fd channel", sealed memory): sized once, then never resized by anyone."""

from __future__ import annotations

import mmap
import os
import tempfile

import pytest

from cuctxd.protos.memfd import resize_sealed, sealed_memfd


def test_a_sealed_memfd_has_its_size_and_cannot_be_resized_through_any_fd_of_it() -> None:
    fd = sealed_memfd("test-sealed", 8192)
    other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # as a process of the same user opens it by path
    copy = os.dup(fd)  # as a client gets it through the fd channel
    try:
        assert os.fstat(fd).st_size == 8192 and resize_sealed(fd) and resize_sealed(other)
        for target in (fd, copy, other):
            for size in (0, 4096, 16384):
                with pytest.raises(PermissionError):
                    os.ftruncate(target, size)
            with pytest.raises(PermissionError):
                os.posix_fallocate(target, 8192, 4096)
        with mmap.mmap(other, 8192) as mapping:  # mapping and writing work as before
            mapping[-5:] = b"still"
            assert os.pread(fd, 5, 8187) == b"still"
    finally:
        for each in (fd, copy, other):
            os.close(each)


def test_other_files_are_not_sealed() -> None:
    unsealed = os.memfd_create("test-unsealed", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as file:
        assert not resize_sealed(unsealed) and not resize_sealed(file.fileno())
    os.close(unsealed)
