"""The daemon's own resource limits: its open-file limit, raised at start (main thread, before any socket).

Every client connection holds a file descriptor in the daemon; at the usual soft
limit of 1024, about a thousand idle connections would exhaust it, and libzmq
aborts the whole process when its listener cannot accept. The hard limit is what
the administrator allows, so the daemon takes all of it.
"""

from __future__ import annotations

import resource

#: Where an unlimited hard limit is capped (the kernel's usual ``fs.nr_open``).
NOFILE_CAP = 1 << 20


def raise_open_file_limit() -> tuple[int, int]:
    """Set the soft ``RLIMIT_NOFILE`` to the hard one; returns the (old, new) soft limits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft
