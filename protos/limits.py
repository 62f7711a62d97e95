"""Size limits every peer must respect; the daemon enforces them, PROTOCOL.md lists them."""

#: Largest msgpack header frame (request or reply) in bytes.
MAX_HEADER_BYTES = 1 << 20

#: Most entries a reply lists in one array that grows with what clients make (``status``'s sessions,
#: contexts and shares, ``context_stack``); a longer one is cut, and the reply says so
#: (``truncated: true``) and gives the full count. ``status`` lists fewer where that is what keeps its
#: header under MAX_HEADER_BYTES. Also the largest (and default) ``limit`` of a ``list_shared`` page.
MAX_LISTED = 1000

#: Default largest payload frame in bytes; the daemon's ``--max-payload`` may lower or raise it.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30

#: Largest number of payload frames a request may carry.
MAX_PAYLOAD_FRAMES = 1

#: Sizes, offsets and request ids are unsigned and fit in 63 bits.
MAX_HANDLE = (1 << 63) - 1

#: Handles the daemon hands out stay below 2**53, exact even as JavaScript numbers.
MAX_ISSUED_HANDLE = (1 << 53) - 1

#: ``stream_ordered`` entries: kind (1 alloc, 2 free), 7 zero bytes, handle, size (0 for a free),
#: little-endian (``struct`` format ``<B7xQQ``: 24 bytes each).
STREAM_ORDERED_ENTRY = "<B7xQQ"

#: Most entries one ``stream_ordered`` request carries.
MAX_STREAM_ORDERED_ENTRIES = 4096

#: Handles a client chooses (``stream_ordered`` allocations) lie above those the daemon issues:
#: MAX_ISSUED_HANDLE < handle <= MAX_HANDLE.
MIN_CLIENT_HANDLE = (1 << 53)

#: Most failed stream-ordered entries a session's device keeps for later requests to report.
MAX_DEFERRED_ERRORS = 1024

#: The largest buffer taken from a pool (section 8): every larger one is a legacy ``cuMemAlloc`` buffer,
#: shared by IPC handle. Measured on an H200 (driver 580): an importer's ``cuMemPoolImportPointer`` costs
#: about 1.3 ms per GiB of the buffer, against 0.05-0.3 ms for a ``cuIpcOpenMemHandle`` at any size (they
#: cross near 32 MiB), and kills the importing process with SIGSEGV for one allocation of 6 GiB or more.
POOL_BUFFER_MAX = 32 << 20

#: Bytes of a layout one step of a digest check copies to the host and one helper thread hashes (whole
#: 2 MiB leaves, ``verify_shared``; PROTOCOL.md, section 9, "Digests").
DIGEST_CHECK_CHUNK_BYTES = 16 << 20
#: Page-locked staging slots of that size a device's digest check holds at most, only while it runs.
DIGEST_CHECK_SLOTS = 8

#: What the daemon charges each published name beyond its own UTF-8 bytes and its manifest, against
#: ``max_manifest_bytes_per_*``: what it keeps of any name (its entries in the name table, the sorted
#: indexes ``list_shared`` pages through, the share's own set), measured with tracemalloc, rounded up.
NAME_OVERHEAD_BYTES = 512

#: Most ``wait_version`` requests one session may have waiting on one device at a time (section 9, "Versions").
MAX_VERSION_WAITERS = 16
#: Longest wait one ``wait_version`` may ask for, in milliseconds (one hour); the Python client asks again after
#: one that passed without a new version when it was told to wait without a timeout.
MAX_VERSION_WAIT_MS = 3_600_000
