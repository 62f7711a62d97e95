"""Versions, each defined in this one place: the wire protocol's (PROTOCOL.md states it too) and the package's.

Both sides import them from here: the daemon reports both in ``hello``, the client and ``cuctx --version`` too.
"""

#: Bumped on any incompatible change to message shapes, ops or error codes.
PROTOCOL_VERSION = 1

#: The release of cuctxd (pyproject.toml reads it from here).
__version__ = "0.1.0"
