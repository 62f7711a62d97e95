"""The wire protocol's version: the one place it is defined (PROTOCOL.md states it too)."""

#: Bumped on any incompatible change to message shapes, ops or error codes.
PROTOCOL_VERSION = 1
