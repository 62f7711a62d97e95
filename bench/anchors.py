"""The bare ZeroMQ anchors: a ROUTER server and a DEALER client with no daemon in between.

:func:`serve_anchor` runs in its own (spawned) process. Per message it does
what a minimal msgpack RPC server must do and nothing more: decode the header,
encode a reply header. Three ops:

* ``ping`` — the echo: reply ``{id, ok, result: {}}``.
* ``sink`` — take a payload frame and drop it (reply with its size): the anchor for writes.
* ``source`` — reply with ``args.size`` bytes as a payload frame: the anchor for reads.
  Started with a ``device`` (see :func:`start_anchor`), the server first reads
  those bytes from a device buffer with the driver's synchronous device-to-host
  copy, as the daemon's ``read`` does: the anchor for what the daemon adds to the
  driver call.

:class:`RawClient` is the matching DEALER with the same msgpack work per call as
the client library; it also speaks to the daemon itself (``ping`` needs no session),
which separates the client library's cost from the daemon's.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import zmq

#: Largest ``source`` reply the anchor server can give.
SOURCE_CAPACITY = 64 << 20
#: Seconds a RawClient waits for a reply before raising instead of hanging.
RAW_TIMEOUT_S = 60


#: Largest ``source`` reply read from the device, when the server has one.
DEVICE_SOURCE_CAPACITY = 1 << 20


@dataclass(frozen=True)
class AnchorDevice:
    """The device a ``source`` reply is read from: ``backend`` ``cuda`` (the device with ``uuid``) or ``sim``."""

    backend: str
    uuid: str | None = None


def serve_anchor(ipc_endpoint: str, conn: Connection, device: AnchorDevice | None = None) -> None:
    """Bind ``ipc_endpoint`` and a random tcp://127.0.0.1 port, report both on ``conn``, serve forever.

    Runs until the process is terminated; one thread, one socket. With a
    ``device``, a driver that cannot be opened is reported on ``conn`` as
    ``("error", reason)`` instead of the endpoints.
    """
    read_device = None
    if device is not None:
        try:
            read_device = _DeviceSource(device)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            conn.close()
            return
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ipc_endpoint)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(("ok", (ipc_endpoint, f"tcp://127.0.0.1:{port}")))
    conn.close()
    source = memoryview(pattern(SOURCE_CAPACITY))
    limit = SOURCE_CAPACITY
    if read_device is not None:
        source, limit = read_device.out, DEVICE_SOURCE_CAPACITY
    packb, unpackb = msgpack.packb, msgpack.unpackb
    while True:
        identity = router.recv()
        header = router.recv()
        payload = router.recv(copy=False) if router.rcvmore else None
        while router.rcvmore:
            router.recv(copy=False)
        request = unpackb(header)
        op = request.get("op")
        if op == "source":
            size = min(int(request["args"]["size"]), limit)
            if read_device is not None:
                read_device.read(size)
            reply = packb({"id": request["id"], "ok": True, "result": {"size": size}})
            router.send_multipart([identity, reply, source[:size]], copy=False)
        elif op == "sink":
            size = len(payload) if payload is not None else 0
            router.send_multipart([identity, packb({"id": request["id"], "ok": True, "result": {"size": size}})])
        else:
            router.send_multipart([identity, packb({"id": request["id"], "ok": True, "result": {}})])


@dataclass
class AnchorServer:
    """A running anchor process and its two endpoints; :meth:`stop` always ends it."""

    process: multiprocessing.process.BaseProcess
    ipc: str
    tcp: str

    def endpoint(self, transport: str) -> str:
        return self.ipc if transport == "ipc" else self.tcp

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: multiprocessing.process.BaseProcess, timeout: float = 5.0) -> None:
    """Terminate a spawned process, then kill it if it lingers."""
    if process.is_alive():
        process.terminate()
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)


class _DeviceSource:
    """A device buffer filled with :func:`pattern`, read back into host memory before each ``source`` reply."""

    def __init__(self, device: AnchorDevice) -> None:
        from bench.cuda_local import LocalCuda, LocalSim

        self.local = LocalCuda(device.uuid) if device.backend == "cuda" else LocalSim()
        self.ptr = self.local.alloc(DEVICE_SOURCE_CAPACITY)
        self.local.htod(self.ptr, pattern(DEVICE_SOURCE_CAPACITY), DEVICE_SOURCE_CAPACITY)
        self.out = memoryview(bytearray(DEVICE_SOURCE_CAPACITY))

    def read(self, size: int) -> None:
        self.local.dtoh(self.out, self.ptr, size)


class AnchorUnavailable(RuntimeError):
    """The anchor server could not open the device it was to read from."""


def start_anchor(ipc_endpoint: str, timeout: float = 60.0, device: AnchorDevice | None = None) -> AnchorServer:
    """Start :func:`serve_anchor` in a spawned process; :class:`AnchorUnavailable` if its device would not open."""
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe(duplex=False)
    process = mp.Process(target=serve_anchor, args=(ipc_endpoint, child, device), name="bench-anchor",
                         daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"the anchor server did not start within {timeout:.0f} s")
        kind, value = parent.recv()
        if kind == "error":
            raise AnchorUnavailable(f"the anchor server could not open its device: {value}")
        ipc, tcp = value
    except BaseException:
        stop_process(process)
        raise
    finally:
        parent.close()
    return AnchorServer(process, ipc, tcp)


class RawClient:
    """A bare DEALER: msgpack-encode the header, send, receive, msgpack-decode. One thread only."""

    def __init__(self, endpoint: str, context: zmq.Context[Any] | None = None) -> None:
        self._socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, RAW_TIMEOUT_S * 1000)
        self._socket.connect(endpoint)
        self._next_id = 1

    def call(self, op: str, args: dict[str, Any] | None = None, payload: Any = None, into: Any = None) -> Any:
        """One round trip; ``payload`` goes out as a second frame, a reply frame lands in ``into``."""
        request: dict[str, Any] = {"id": self._next_id, "op": op}
        self._next_id += 1
        if args:
            request["args"] = args
        header = msgpack.packb(request)
        if payload is None:
            self._socket.send(header)
        else:
            self._socket.send_multipart([header, payload], copy=False)
        reply = msgpack.unpackb(self._socket.recv())
        while self._socket.rcvmore:
            if into is not None:
                self._socket.recv_into(into)
                into = None
            else:
                self._socket.recv(copy=False)
        if not reply.get("ok"):
            raise RuntimeError(f"{op} failed: {reply.get('error')}")
        return reply["result"]

    def ping(self) -> None:
        self.call("ping")

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pattern(size: int) -> bytes:
    """``size`` bytes of real, touched memory (``bytes(n)`` maps lazy zero pages, which read too fast)."""
    block = bytes(range(256)) * 4096
    whole, rest = divmod(size, len(block))
    return block * whole + block[:rest]
