"""Ops that manage the daemon rather than a session's own objects (protocol version 1): closing another
session, and asking the daemon to shut down.

Both are answered by the front. Who may: the daemon's own user (the uid it runs as) is its administrator;
``close_session`` is allowed to it and to the closed session's own user, ``shutdown`` to it alone. A peer
whose uid the daemon cannot know (tcp://) is neither (``CUCTXD_ERROR_NOT_OWNER``).
"""

from __future__ import annotations

from cuctxd.protos.schema import op, required_count


@op("close_session", target="front")
class CloseSession:
    """Close the session whose public id is ``session_id`` as its ``goodbye`` would (``cuctx kill``): its
    holds, streams, events, contexts and memory go, except what the sharing lifetime rule keeps; its client's
    next request fails with ``CUCTXD_ERROR_SESSION_CLOSED``. Allowed to the daemon's user and the session's
    own user. Result: ``{}``, once every device has closed it."""

    session_id: int = required_count(minimum=1)


@op("shutdown", target="front")
class Shutdown:
    """Stop the daemon as SIGTERM does (drain, then exit 0); allowed only to the daemon's own user.
    Result: ``{}``, sent before the drain starts."""
