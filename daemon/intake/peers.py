"""Who is on the other end of a request, for ``max_sessions_per_peer``.

ZeroMQ hides connections behind ROUTER identities, which a client picks anew
with every socket, so they say nothing about who it is. What the daemon can
trust, best first:

* ``key:<z85>`` — with CURVE, the client's public key, which the ZAP
  authenticator puts in every frame's ``User-Id`` property: the one truly
  authenticated identity.
* ``address:<ip>`` — on plaintext tcp://, the ``Peer-Address`` property of the
  frame: every client on one host counts as one peer.
  On ipc:// libzmq reports the kernel's credentials of the connecting process
  (``SO_PEERCRED``) there, as ``localhost:<uid>:<gid>:<pid>``: one peer per
  process, and :func:`uid_of` reads the uid (scoped share names, ``lookup``'s
  publisher).
* ``pid:<n>`` — only where the frames say nothing: the pid the client reports
  in ``hello``, which a client can lie about.

The front reads the frame's properties for ``hello`` only.
"""

from __future__ import annotations

from typing import Any

import zmq


def peer_of(frame: zmq.Frame) -> str | None:
    """The peer a received frame came from (``key:`` or ``address:``), or None when it does not say."""
    for prop, prefix in (("User-Id", "key:"), ("Peer-Address", "address:")):
        try:
            value: Any = frame.get(prop)
        except zmq.ZMQError:  # EINVAL: the frame carries no such property
            continue
        if value:
            return prefix + str(value)
    return None


def peer_or_pid(peer: str | None, pid: int) -> str:
    """``peer`` as the frames gave it, else the pid the client reported in hello."""
    return peer if peer is not None else f"pid:{pid}"


def pid_of(peer: str | None) -> int | None:
    """The peer's pid from an ipc:// ``address:<host>:<uid>:<gid>:<pid>`` peer; None when it does not say."""
    if peer is None or not peer.startswith("address:"):
        return None
    parts = peer.split(":")
    if len(parts) != 5 or not parts[4].isdigit():
        return None
    return int(parts[4])


def uid_of(peer: str | None) -> int | None:
    """The peer's uid from an ipc:// ``address:<host>:<uid>:<gid>:<pid>`` peer; None when it does not say."""
    if peer is None or not peer.startswith("address:"):
        return None
    parts = peer.split(":")
    if len(parts) != 5 or not parts[2].isdigit():
        return None
    return int(parts[2])
