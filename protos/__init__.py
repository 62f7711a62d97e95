"""cuctxd's wire protocol: op names and shapes, error codes, framing, the version.

PROTOCOL.md in this package is the authoritative written spec.
"""

from cuctxd.protos import ops as ops  # registers every op in protos.schema.OPS
from cuctxd.protos import pinned_ops as pinned_ops
from cuctxd.protos import sharing_ops as sharing_ops
from cuctxd.protos import stream_ops as stream_ops
from cuctxd.protos import system_ops as system_ops
from cuctxd.protos.version import PROTOCOL_VERSION as PROTOCOL_VERSION
