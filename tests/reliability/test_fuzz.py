"""Fuzz the daemon's front door: nothing a client sends may stop it, hang it, or touch another session.

One real sim daemon (2 devices of 64 MiB, a 64 KiB payload limit, so no input
can make it hold much memory) serves the module. A *bystander* session, set up
once, owns buffers with known bytes on both devices, a created context on its
stack, a stream, an event and a published share; a *probe* session on the
fuzzing connection never binds anything. The inputs: random bytes as header
frames, multipart messages of 1..5 random frames (a DEALER cannot send 0),
random msgpack values as headers, and requests built from ``cuctxd.protos.schema.OPS``
with mutated fields (strategies.py), one at a time and as pipelined bursts.
For every input:

* exactly one reply comes, within :data:`REPLY_DEADLINE` (a sentinel round after
  each example catches extra or late replies);
* its shape is valid, with the id and envelope error the oracle predicts
  (``strategies.expect``), and never ``CUCTXD_ERROR_INTERNAL``;
* a request naming the bystander's handles, or handles never issued, fails.

After every example the daemon answers ``ping``, the probe's stacks are still
empty and every live context can be synchronized; every :data:`CHECK_EVERY`
examples and after each test the bystander's bytes, stacks, share and
accounting are unchanged. Fixed tests pin down what the fuzz found (stream
handles on empty transfers, waits failed by a later ``destroy_context``). The
last test checks that the fuzz sessions left nothing behind. CI draws a few
hundred to a thousand examples per test, derandomized (the same inputs every
run); ``CUCTXD_SOAK=1`` (or ``--soak``) draws 50x as many at random
(``CUCTXD_SOAK_FACTOR`` changes the factor). A failed example resets the
fuzzing connection, so that replies still due cannot fail the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuctxd.client import Buffer, Client, Event, Stream
from cuctxd.protos.errors import ErrorCode
from cuctxd.protos.limits import MAX_LISTED
from cuctxd.protos.schema import OPS
from tests.helpers import DaemonProcess, remove_tempdir, start_daemon
from tests.helpers_raw import RawPeer
from tests.reliability.strategies import (
    BUFFER_SIZE,
    HANDLE_ROLES,
    INPUTS,
    OP_ARGS,
    Expected,
    RequestPlan,
    World,
    expect_frames,
    fuzz_settings,
    garbage_headers,
    header_like,
    msgpack_values,
    pack,
    payload_junk,
    registry_plans,
    request_plans,
    shape_problem,
    soak_mode,
    valid_id,
)

MAX_PAYLOAD = 64 * 1024
DEVICES = 2
#: Seconds any reply may take; the sim answers these inputs in well under a millisecond.
REPLY_DEADLINE = 5.0
#: Examples between full checks of the bystander.
CHECK_EVERY = 25
#: Most requests a pipelined burst sends before reading a reply: well under ZeroMQ's 1000-message queues.
BURST = 60
SHARE_NAME = "bystander-weights"
#: Names the crowd publishes, and the sessions publishing them, for the registry tests: several pages.
CROWD_NAMES = 3000
CROWD_SESSIONS = 3

pytestmark = pytest.mark.timeout(0 if soak_mode() else 120)


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[DaemonProcess]:
    process = start_daemon("--sim-devices", str(DEVICES), "--sim-memory", "64MiB", "--max-payload", str(MAX_PAYLOAD),
                           "--lease-ttl", "30")
    yield process
    code = process.stop()
    remove_tempdir(process.socket_dir)
    log = process.log()
    assert code == 0, f"cuctxd exited with {code}:\n{log[-5000:]}"
    assert "Traceback" not in log, f"the daemon logged a traceback:\n{log[log.index('Traceback') - 2000:][:6000]}"


# --- the bystander ---------------------------------------------------------------------------------


@dataclass
class Bystander:
    """A session the fuzz must never affect; :meth:`check` proves it was not."""

    client: Client
    buffers: list[tuple[Buffer, bytes]]
    stacks: dict[int, list[int]]
    handles: dict[str, list[tuple[int, int]]]
    stream: Stream
    event: Event
    share_id: str
    #: The device of the share's one copy: a ``lookup`` or ``verify_shared`` of the name on another is NO_COPY.
    share_device: int
    usage: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    device_free: list[int] = field(default_factory=list)

    def foreign_values(self) -> set[int]:
        return {handle for kind in self.handles.values() for handle, _ in kind}

    def _usage(self) -> dict[int, tuple[int, int, int, int]]:
        found = {}
        for device in self.client.status()["devices"]:
            for entry in device["sessions"]:
                if entry["session"] == self.client.session_id:
                    found[device["device"]] = (entry["contexts"], entry["stack_depth"], entry["allocations"],
                                               entry["bytes"])
        return found

    def check(self) -> None:
        INPUTS["fuzz: bystander checks"] += 1
        assert self.client.ping() > 0
        for buffer, data in self.buffers:
            assert buffer.read() == data, f"the bystander's buffer on device {buffer.device} changed"
        for device, stack in self.stacks.items():
            assert [c.handle for c in self.client.context_stack(device)] == stack, \
                f"the bystander's context stack on device {device} changed"
        assert self.client.get_device() == 1
        assert self.client.lookup(SHARE_NAME).share_id == self.share_id
        assert isinstance(self.stream.query(), bool) and isinstance(self.event.query(), bool)
        assert self._usage() == self.usage, "the bystander's contexts, stacks or allocations changed"


@pytest.fixture(scope="module")
def bystander(fuzz_daemon: DaemonProcess) -> Iterator[Bystander]:
    rng = random.Random(20240601)
    with Client(fuzz_daemon.endpoint, timeout=10, name="bystander") as client:
        on_one = client.alloc(64 * 1024, device=1)
        context = client.create_context(device=0)
        on_zero = client.alloc(32 * 1024, device=0)
        shared = client.alloc(BUFFER_SIZE, device=1, shareable=True)
        stream, event = client.create_stream(device=0), client.create_event(device=0)
        buffers = []
        for buffer in (on_one, on_zero, shared):
            data = rng.randbytes(buffer.size)
            buffer.write(data)
            buffers.append((buffer, data))
        share = client.publish(shared, SHARE_NAME)
        primary = client.set_device(1)
        event.record(stream)
        who = Bystander(
            client, buffers, {0: [context.handle], 1: [primary.handle]},
            {"buffer": [(b.handle, b.device) for b in (on_one, on_zero, shared)],
             "context": [(context.handle, 0), (primary.handle, 1)],
             "stream": [(stream.handle, 0)], "event": [(event.handle, 0)]},
            stream, event, share.share_id, shared.device,
        )
        who.usage = who._usage()
        who.device_free = [int(client.memory_info(d)["device_free"]) for d in range(DEVICES)]
        who.check()
        yield who
        client.unpublish(SHARE_NAME)  # a published share outlives its session; do not leave it to the daemon
        shared.free()


# --- the fuzzing connection ------------------------------------------------------------------------


def _short(frames: Sequence[bytes]) -> str:
    return ", ".join(f"{len(f)} bytes {f[:80]!r}" for f in frames)


class Harness:
    """The fuzzing DEALER, the probe session on it, and what the oracle knows (one per module)."""

    def __init__(self, endpoint: str, bystander: Bystander) -> None:
        self.endpoint = endpoint
        self.peer = RawPeer(endpoint)
        self.probe = self.peer.hello()
        self.world = World(DEVICES, MAX_PAYLOAD, {self.probe: 0})
        self.bystander = bystander
        self.examples = 0

    @contextlib.contextmanager
    def resets_on_failure(self, token: str | None = None) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.reset(token)
            raise

    def reset(self, token: str | None) -> None:
        """After a failed example: a fresh connection (replies still due go to the old one, so they
        cannot be mistaken for the next example's), and the failed example's session ended."""
        self.peer.close()
        self.peer = RawPeer(self.endpoint)
        if token is not None and token in self.world.current_device:
            self.world.current_device.pop(token)
            self.peer.call("goodbye", {}, token)
        self.release_orphans()

    def roundtrip(self, frames: Sequence[bytes], expected: Expected, kind: str) -> tuple[dict[str, Any], list[bytes]]:
        """Send one input; its one reply must come in time, be well formed and match the oracle."""
        INPUTS[kind] += 1
        self.peer.send_frames(frames)
        try:
            header, payload = self.peer.recv(REPLY_DEADLINE)
        except AssertionError:
            raise AssertionError(f"no reply within {REPLY_DEADLINE} s to: {_short(frames)}") from None
        problem = shape_problem(header, payload, expected)
        assert problem is None, f"{problem}\n  request: {_short(frames)}"
        if expected.error is not None:
            assert header["ok"] is False and header["error"]["name"] == expected.error, (
                f"expected {expected.error}, got {header}\n  request: {_short(frames)}")
        if header["ok"] and expected.spec is not None and expected.spec.name == "hello":
            self.peer.ok("goodbye", {}, header["result"]["session"])  # a session the fuzz opened by chance
        return header, payload

    def after_example(self) -> None:
        """Nothing else is queued for us, the daemon answers ping, the probe is untouched, and every
        context alive on each device can still be synchronized (none is left half-destroyed)."""
        stacks = {self.peer.send("context_stack", {"device": d}, self.probe): d for d in range(DEVICES)}
        syncs = {self.peer.send("device_synchronize", {"device": d}, self.probe): d for d in range(DEVICES)}
        waiting = {*stacks, *syncs, self.peer.send("ping")}
        while waiting:
            header, _ = self.peer.recv(REPLY_DEADLINE)
            assert header.get("id") in waiting, f"a reply no request was waiting for: {header!r}"
            waiting.discard(header["id"])
            assert header["ok"] is True, f"after the example: {header}"
            if header["id"] in stacks:
                assert header["result"]["stack"] == [], "the probe's context stack changed"
        self.examples += 1
        if self.examples % CHECK_EVERY == 0:
            self.bystander.check()

    def call(self, op: str, args: dict[str, Any], token: str) -> dict[str, Any]:
        return self.peer.ok(op, args, token)[0]

    def release_orphans(self) -> None:
        """Free shares whose fuzz owner ended while they were published: a name stays until unpublished (or its
        orphan TTL), and the probe, of the fuzz sessions' uid, may unpublish it."""
        for entry in self.call("list_shared", {}, self.probe)["shared"]:
            if entry["owner"] != self.bystander.client.session_id and not entry["owner_present"]:
                self.call("unpublish", {"name": entry["name"]}, self.probe)


@pytest.fixture(scope="module")
def harness(fuzz_daemon: DaemonProcess, bystander: Bystander) -> Iterator[Harness]:
    fuzzer = Harness(fuzz_daemon.endpoint, bystander)
    yield fuzzer
    fuzzer.peer.close()


# --- a fuzz session: one per example of mutated requests ----------------------------------------------


class FuzzSession:
    """A session on the fuzzing connection with objects to aim at; resolves plans into frames."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness
        self.token = harness.peer.hello()
        harness.world.current_device[self.token] = 0
        self.own: dict[str, list[tuple[int, int]]] = {role: [] for role in HANDLE_ROLES}
        self.shares: list[tuple[str, int]] = []
        self.names: list[str] = []
        call = self._call
        pool = call("alloc", {"size": BUFFER_SIZE, "device": 0})["buffer"]
        shareable = call("alloc", {"size": BUFFER_SIZE, "device": 1, "shareable": True})["buffer"]
        self.own["buffer"] += [(pool["handle"], 0), (shareable["handle"], 1)]
        self.shares.append((call("export", {"buffer": shareable["handle"], "device": 1})["share"]["share_id"], 1))
        self.own["stream"].append((call("create_stream", {"device": 0})["stream"], 0))
        self.own["event"].append((call("create_event", {"device": 0})["event"], 0))
        self.own["context"].append((call("create_context", {"device": 0})["context"]["handle"], 0))

    def _call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        return self.h.call(op, args, self.token)

    @property
    def alive(self) -> bool:
        return self.token in self.h.world.current_device

    def issued(self) -> set[int]:
        return {handle for kind in self.own.values() for handle, _ in kind}

    # resolving abstract choices -------------------------------------------------------------------

    def _value(self, role: str, choice: Any, devices: list[int]) -> Any:
        bystander = self.h.bystander
        if role in HANDLE_ROLES:
            pool = {"own": self.own[role], "foreign": bystander.handles[role]}.get(choice[0])
            if pool is None:
                return choice[1]
            handle, device = pool[choice[1] % len(pool)] if pool else (choice[1] + 1, 0)
            devices.append(device)
            return handle
        if role == "device":
            if choice[0] == "match":
                return devices[0] if devices else self.h.world.current_device.get(self.token, 0)
            return choice[1]
        if role == "share_id":
            if choice[0] == "own_share":
                return self.shares[choice[1] % len(self.shares)][0] if self.shares else "0" * 32
            return bystander.share_id if choice[0] == "foreign_share" else choice[1]
        if role == "share_name":
            if choice[0] == "own_name":
                return self.names[choice[1] % len(self.names)] if self.names else f"fz-{choice[1]}"
            return SHARE_NAME if choice[0] == "foreign_name" else choice[1]
        return choice

    def _args(self, op: str, plan: tuple[Any, ...]) -> tuple[bool, Any]:
        """(present, value) of the header's ``args``."""
        if plan[0] == "absent":
            return False, None
        if plan[0] in ("nil", "raw"):
            return True, plan[1] if plan[0] == "raw" else None
        _, choices, extras = plan
        args: dict[Any, Any] = {}
        devices: list[int] = []
        ordered = sorted(OP_ARGS[op].args, key=lambda a: a.role == "device")  # handles first, for "match"
        for arg in ordered:
            kind, *rest = choices[arg.name]
            if kind == "omit":
                continue
            args[arg.name] = None if kind == "nil" else rest[0] if kind == "raw" else \
                self._value(arg.role, rest[0], devices)
        takes_name = op == "unpublish" or (op == "publish" and True in (args.get("replace"), args.get("version")))
        if takes_name and args.get("name") == SHARE_NAME:  # a session of the publisher's uid may unpublish (or
            args["name"] = f"fz-{SHARE_NAME}"  # replace) it (PROTOCOL.md section 9), and the fuzz runs as that uid
        for key, value in extras:
            args[key] = value
        return True, args

    def frames(self, plan: RequestPlan) -> list[bytes]:
        header: dict[str, Any] = {}
        if plan.id[0] != "absent":
            header["id"] = self.h.peer.next_id() if plan.id[0] == "fresh" else plan.id[1]
        if plan.op != ("absent",):
            header["op"] = plan.op if isinstance(plan.op, str) else plan.op[1]
        kind, *value = plan.session
        if kind != "absent":
            header["session"] = self.token if kind == "own" else None if kind == "nil" else value[0]
        present, args = self._args(plan.args_op, plan.args)
        if present:
            header["args"] = args
        count, sizes = plan.frames
        spec = OPS.get(header.get("op")) if isinstance(header.get("op"), str) else None
        if count == "expected":
            count = 1 if spec is not None and spec.payload_in else 0
        lengths = [{"max": MAX_PAYLOAD, "max+1": MAX_PAYLOAD + 1}.get(s, s) for s in sizes[:count]]
        return [pack(header), *(bytes([n % 251]) * n for n in lengths)]

    # running a plan ----------------------------------------------------------------------------------

    def predict(self, frames: list[bytes]) -> tuple[Expected, int | None]:
        """The oracle's expectation, and what it implies for the session's state once the front has it:
        ``set_device`` moves the current device and ``goodbye`` ends the session at once (PROTOCOL.md
        section 3). Also returns the current device a ``get_device`` must report."""
        world = self.h.world
        expected = expect_frames(frames, world)
        device_now = world.current_device.get(expected.session) if expected.session is not None else None
        if expected.error is None and expected.spec is not None:
            if expected.spec.name == "set_device":
                world.current_device[expected.session] = expected.device  # type: ignore[index,assignment]
            elif expected.spec.name == "goodbye":
                world.current_device.pop(expected.session, None)  # type: ignore[arg-type]
        return expected, device_now

    def run(self, plan: RequestPlan) -> None:
        frames = self.frames(plan)
        expected, device_now = self.predict(frames)
        header, payload = self.h.roundtrip(frames, expected, "fuzz: mutated requests")
        if expected.error is None:
            self.check(expected, device_now, header, payload, frames)

    def check(self, expected: Expected, device_now: int | None, header: dict[str, Any], payload: list[bytes],
              frames: list[bytes]) -> None:
        """What must hold of a reply to a request that reached its op; then note what it created."""
        INPUTS["fuzz: mutated requests that reached their op"] += 1
        INPUTS["fuzz: mutated requests that succeeded"] += bool(header["ok"])
        spec, args, ok = expected.spec, expected.args or {}, header["ok"]
        assert spec is not None
        name = spec.name
        what = f"{name} {args!r} -> {header!r}"
        foreign = self.h.bystander.foreign_values()
        named = [args[a.name] for a in OP_ARGS[name].args if a.role in HANDLE_ROLES and args.get(a.name) is not None]
        if any(h in foreign for h in named):
            assert not ok, f"a request naming the bystander's handle succeeded: {what}"
        if any(h not in self.issued() and h not in foreign for h in named):
            assert not ok, f"a request naming a handle the daemon never issued succeeded: {what}"
        if name in ("ping", "device_count", "devices", "get_device", "heartbeat", "list_shared", "status",
                    "goodbye", "context_stack", "current_context", "device_synchronize"):
            assert ok, f"{name} cannot fail here: {what}"
        if name == "hello":
            assert ok == (args.get("protocol") == 1), what
        if name == "get_device":
            assert header["result"]["device"] == device_now, what
        if name == "device_count":
            assert header["result"]["count"] == DEVICES
        if name == "lookup" and args.get("name") == SHARE_NAME and args.get("version") is not None:
            assert not ok and header["error"]["name"] == ErrorCode.CUCTXD_ERROR_NOT_FOUND.name, what  # no versions
        elif name in ("lookup", "verify_shared") and args.get("name") == SHARE_NAME:
            self._check_bystanders_name(name, expected.device if name == "verify_shared" else args.get("device"),
                                        header, what)
        if ok and spec.payload_out:
            assert len(payload) == 1 and len(payload[0]) == header["result"]["size"], what
        elif ok:
            assert payload == [], what
        if ok and name == "write":
            assert header["result"]["size"] == len(frames[1]), what
        if ok:
            self._record(name, expected.device, args, header["result"], what)

    def _check_bystanders_name(self, name: str, device: int | None, header: dict[str, Any], what: str) -> None:
        """A ``lookup`` or ``verify_shared`` of the bystander's name: on a device without its copy (a name has one
        copy per device), NO_COPY; a ``lookup`` with no device, or with the copy's, finds the bystander's share."""
        if device is not None and device != self.h.bystander.share_device:
            assert not header["ok"] and header["error"]["name"] == ErrorCode.CUCTXD_ERROR_NO_COPY.name, what
        elif name == "lookup":
            assert header["ok"] and header["result"]["share"]["share_id"] == self.h.bystander.share_id, what

    def _record(self, name: str, device: int | None, args: Any, result: dict[str, Any], what: str) -> None:
        if name == "alloc":
            assert result["buffer"]["device"] == device and result["buffer"]["size"] == args["size"], what
            self.own["buffer"].append((result["buffer"]["handle"], device))  # type: ignore[arg-type]
        elif name in ("create_context", "set_device"):
            self.own["context"].append((result["context"]["handle"], device))  # type: ignore[arg-type]
        elif name in ("create_stream", "create_event"):
            role = name.removeprefix("create_")
            self.own[role].append((result[role], device))  # type: ignore[arg-type]
        elif name in ("export", "publish"):
            self.shares.append((result["share"]["share_id"], device))  # type: ignore[arg-type]
            if name == "publish":
                self.names.append(args["name"])

    def close(self) -> None:
        """Unpublish, goodbye, free any published share left behind, and check nothing else is queued."""
        if self.alive:
            for name in self.names:
                header, _ = self.h.peer.call("unpublish", {"name": name}, self.token)
                assert header["ok"] or header["error"]["name"] == "CUCTXD_ERROR_NOT_FOUND", header
            assert self._call("goodbye", {}) == {}
            self.h.world.current_device.pop(self.token)
        self.h.release_orphans()
        self.h.after_example()


@contextlib.contextmanager
def fuzz_session(harness: Harness) -> Iterator[FuzzSession]:
    """A fresh fuzz session, closed and checked after the example; after a failure the harness is
    reset instead, so that one failure cannot make the examples hypothesis tries next fail too."""
    session: FuzzSession | None = None
    try:
        session = FuzzSession(harness)
        yield session
    except BaseException:
        harness.reset(None if session is None else session.token)
        raise
    session.close()


# --- the tests -------------------------------------------------------------------------------------


def test_random_header_frames_and_multipart_messages(harness: Harness) -> None:
    @fuzz_settings(400)
    @given(header=garbage_headers, payload=st.lists(payload_junk, max_size=4))
    def one_message(header: bytes, payload: list[bytes]) -> None:
        frames = [header, *payload]
        with harness.resets_on_failure():
            harness.roundtrip(frames, expect_frames(frames, harness.world), "fuzz: random frames")
            harness.after_example()

    one_message()
    harness.bystander.check()


def test_random_msgpack_values_as_headers(harness: Harness) -> None:
    @fuzz_settings(400)
    @given(value=st.one_of(msgpack_values, header_like, header_like), payload=st.lists(payload_junk, max_size=2))
    def one_header(value: Any, payload: list[bytes]) -> None:
        frames = [pack(value), *payload]
        with harness.resets_on_failure():
            harness.roundtrip(frames, expect_frames(frames, harness.world), "fuzz: msgpack headers")
            harness.after_example()

    one_header()
    harness.bystander.check()


def test_mutated_requests_of_every_op(harness: Harness) -> None:
    @fuzz_settings(1200)
    @given(plans=st.lists(request_plans, min_size=1, max_size=8))
    def one_session(plans: list[RequestPlan]) -> None:
        session = FuzzSession(harness)
        try:
            for plan in plans:
                session.run(plan)
        finally:
            session.close()

    one_session()
    harness.bystander.check()


def run_burst(harness: Harness, plans: list[RequestPlan], kind: str) -> None:
    """Send ``plans`` without waiting, in a fresh fuzz session: replies may come in any order, but each request
    gets exactly its own one, within REPLY_DEADLINE. (Only requests whose header has no readable id share a
    reply id, 0; they differ in nothing else.)"""
    with fuzz_session(harness) as session:
        waiting: dict[int, list[tuple[Expected, int | None, list[bytes]]]] = {}
        opened: list[str] = []
        for plan in plans:
            if plan.id[0] == "raw" and valid_id(plan.id[1]):
                plan = dataclasses.replace(plan, id=("fresh",))  # in flight together, ids must differ
            frames = session.frames(plan)
            expected, device_now = session.predict(frames)
            INPUTS[kind] += 1
            harness.peer.send_frames(frames)
            waiting.setdefault(expected.reply_id, []).append((expected, device_now, frames))
        for _ in plans:
            header, payload = harness.peer.recv(REPLY_DEADLINE)
            candidates = waiting.get(header.get("id"), [])
            fits = [c for c in candidates if shape_problem(header, payload, c[0]) is None
                    and (c[0].error is None or header.get("error", {}).get("name") == c[0].error)]
            assert fits, f"a reply that answers none of the requests in flight: {header!r}\n  {candidates!r}"
            expected, device_now, frames = fits[0]
            candidates.remove(fits[0])
            if expected.error is None:
                session.check(expected, device_now, header, payload, frames)
                if header["ok"] and expected.spec is not None and expected.spec.name == "hello":
                    opened.append(header["result"]["session"])
        for token in opened:  # sessions the fuzz opened by chance, ended once no reply is due
            harness.call("goodbye", {}, token)


def run_bursts(harness: Harness, plans: st.SearchStrategy[RequestPlan], examples: int, kind: str) -> None:
    """``examples`` bursts of 10 to BURST requests drawn from ``plans`` (:func:`run_burst`); then the bystander's
    check."""
    @fuzz_settings(examples)
    @given(burst=st.lists(plans, min_size=10, max_size=BURST))
    def one_burst(burst: list[RequestPlan]) -> None:
        run_burst(harness, burst, kind)

    one_burst()
    harness.bystander.check()


def test_a_pipelined_burst_of_mutated_requests_gets_one_reply_each(harness: Harness) -> None:
    """What each request's reply must be is test_mutated_requests_of_every_op's (1200 sessions of up to 8
    requests, each sent after the last one's reply); here, that each of up to BURST in flight at once gets its
    own: 100 bursts in CI (the soak's 5000)."""
    run_bursts(harness, request_plans, 100, "fuzz: pipelined requests")


# --- a crowded registry: requests whose cost could grow with it ----------------------------------------


@dataclass(frozen=True)
class Crowd:
    """Names published by a few sessions on the fuzzing connection: each name's publisher (public id)."""

    publishers: dict[str, int]


@pytest.fixture
def crowd(harness: Harness) -> Iterator[Crowd]:
    """CROWD_NAMES names from CROWD_SESSIONS sessions (one shareable buffer each), gone after the test: each
    buffer's free unpublishes its names."""
    peer = harness.peer
    publishers: dict[str, int] = {}
    sessions = []
    for n in range(CROWD_SESSIONS):
        hello = peer.ok("hello", {"protocol": 1, "client": f"crowd-{n}", "pid": 1})[0]
        token = hello["session"]
        buffer = peer.ok("alloc", {"size": BUFFER_SIZE, "device": n % DEVICES, "shareable": True}, token)[0]
        sessions.append((token, buffer["buffer"]["handle"], n % DEVICES))
        names = [f"crowd-{m:05d}" for m in range(n, CROWD_NAMES, CROWD_SESSIONS)]
        for start in range(0, len(names), BURST):
            ids = [peer.send("publish", {"buffer": buffer["buffer"]["handle"], "name": name, "device": n % DEVICES},
                             token) for name in names[start:start + BURST]]
            for _ in ids:
                assert peer.recv(REPLY_DEADLINE)[0]["ok"] is True
        publishers.update(dict.fromkeys(names, hello["session_id"]))
    try:
        yield Crowd(publishers)
    finally:  # on the harness's peer of now: a failed example closed the one set up with (Harness.reset)
        for token, handle, device in sessions:
            harness.peer.call("free", {"buffer": handle, "device": device}, token)
            harness.peer.call("goodbye", {}, token)


def test_a_pipelined_burst_of_registry_requests_over_a_crowd_of_names_gets_prompt_replies(
        harness: Harness, crowd: Crowd) -> None:
    """``list_shared`` (any page, any filter), ``lookup``, ``unpublish``, ``status`` and ``publish`` while
    thousands of names are published: each request one reply within REPLY_DEADLINE, as the oracle predicts."""
    run_bursts(harness, registry_plans, 60, "fuzz: pipelined registry requests over a crowd")


def test_pages_of_a_crowd_of_names_list_each_selected_name_once_in_order(harness: Harness, crowd: Crowd) -> None:
    """Paging through with any filter lists exactly the names it selects, in code point order, each page at
    most ``limit`` names and promptly answered."""
    bystander = harness.bystander.client
    publishers = {**crowd.publishers, SHARE_NAME: bystander.session_id}

    @fuzz_settings(60)
    @given(prefix=st.sampled_from(["", "crowd-", "crowd-00", "crowd-01", "crowd-9", "bys", "c", "zz"]),
           owner=st.one_of(st.none(), st.sampled_from(sorted(set(publishers.values()))), st.integers(0, 64)),
           uid=st.sampled_from([None, os.getuid(), 65534]),
           limit=st.one_of(st.sampled_from([1, 7, MAX_LISTED]), st.integers(1, MAX_LISTED)),
           after=st.one_of(st.none(), st.sampled_from(sorted(publishers)), st.text("crowd-0123", max_size=9)))
    def page_through(prefix: str, owner: int | None, uid: int | None, limit: int, after: str | None) -> None:
        expected = sorted(name for name, session in publishers.items()
                          if name.startswith(prefix) and (after is None or name > after)
                          and (owner is None or session == owner) and uid in (None, os.getuid()))
        listed: list[str] = []
        args = {"prefix": prefix, "limit": limit, "owner": owner, "uid": uid, "after": after}
        with harness.resets_on_failure():
            while True:
                INPUTS["fuzz: list_shared pages over a crowd"] += 1
                rid = harness.peer.send("list_shared", {k: v for k, v in args.items() if v is not None},
                                        harness.probe)
                header, _ = harness.peer.recv(REPLY_DEADLINE)
                assert header["id"] == rid and header["ok"] is True, header
                page = header["result"]
                names = [entry["name"] for entry in page["shared"]]
                assert len(names) <= limit and page["count"] == len(publishers) and page["truncated"] == (
                    page["next"] is not None)
                listed += names
                if page["next"] is None:
                    break
                assert page["next"] == names[-1], page["next"]
                args["after"] = page["next"]
            assert listed == expected, (args, len(listed), len(expected))

    page_through()
    harness.bystander.check()


@pytest.mark.parametrize("stream", ["bystander's", "never issued"])
@pytest.mark.parametrize("size", [0, 16])
@pytest.mark.parametrize("op", ["write", "read", "fill", "copy"])
def test_a_transfer_naming_a_stream_not_of_this_session_fails(harness: Harness, op: str, size: int,
                                                              stream: str) -> None:
    """Also when there is nothing to move: a stream handle is checked like any handle (UNKNOWN_HANDLE)."""
    with fuzz_session(harness) as session:
        buffer, device = session.own["buffer"][0]
        handle = harness.bystander.handles["stream"][0][0] if stream == "bystander's" else 0x1234_5679
        args: dict[str, Any] = {"device": device, "stream": handle}
        args.update({"write": {"buffer": buffer}, "read": {"buffer": buffer, "size": size},
                     "fill": {"buffer": buffer, "size": size, "value": 1},
                     "copy": {"src": buffer, "dst": buffer, "size": size, "dst_offset": 2 * size}}[op])
        frames = [pack({"id": harness.peer.next_id(), "op": op, "session": session.token, "args": args}),
                  *([bytes(size)] if op == "write" else [])]
        expected = expect_frames(frames, harness.world)
        assert expected.error is None
        header, _ = harness.roundtrip(frames, expected, "fuzz: fixed requests")
        assert header["ok"] is False and header["error"]["name"] == "CUCTXD_ERROR_UNKNOWN_HANDLE", (
            f"{op} of {size} bytes on {stream} stream {handle:#x}: {header}")


def _wait_then_destroy(peer: RawPeer, case: str, waiter: str, other: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The two requests of a case: one that waits, and one, sent right after it, that ends something."""
    if case == "device_synchronize, then another session's goodbye":
        peer.ok("create_context", {"device": 0}, other)
        return ("device_synchronize", {"device": 0}, waiter), ("goodbye", {}, other)
    if case == "device_synchronize, then another session's destroy_context":
        context = peer.ok("create_context", {"device": 0}, other)[0]["context"]["handle"]
        return ("device_synchronize", {"device": 0}, waiter), ("destroy_context", {"context": context, "device": 0},
                                                               other)
    context = peer.ok("create_context", {"device": 0}, waiter)[0]["context"]["handle"]
    destroy = ("destroy_context", {"context": context, "device": 0}, waiter)
    if case == "synchronize, then destroy_context of the current context":
        return ("synchronize", {"device": 0}, waiter), destroy
    stream = peer.ok("create_stream", {"device": 0}, waiter)[0]["stream"]
    buffer = peer.ok("alloc", {"size": BUFFER_SIZE, "device": 0}, waiter)[0]["buffer"]["handle"]
    return ("write", {"buffer": buffer, "stream": stream, "device": 0}, waiter, [bytes(BUFFER_SIZE)]), destroy


@pytest.mark.parametrize("case", [
    "device_synchronize, then another session's goodbye",
    "device_synchronize, then another session's destroy_context",
    "synchronize, then destroy_context of the current context",
    "write on a stream, then destroy_context of the stream's context",
])
def test_a_waiting_op_is_not_failed_by_a_context_destroyed_after_it(harness: Harness, case: str) -> None:
    """Found by the pipelined fuzz. A waiting op covers the work queued before it (PROTOCOL.md section 3);
    a context destroyed by a later request (even another session's) must not turn it into an error,
    as it would not if the two requests had been sent one at a time."""
    peer = harness.peer
    waiter, other = peer.hello(), peer.hello()
    try:
        with harness.resets_on_failure():
            first, second = _wait_then_destroy(peer, case, waiter, other)
            ids = [peer.send(*first), peer.send(*second)]
            replies = {}
            for _ in ids:
                header, _ = peer.recv(REPLY_DEADLINE)
                replies[header["id"]] = header
            assert replies[ids[1]]["ok"] is True, replies[ids[1]]
            assert replies[ids[0]]["ok"] is True, (
                f"{first[0]} failed because of a later {second[0]}: {replies[ids[0]]}")
    finally:
        for token in (waiter, other):
            harness.peer.call("goodbye", {}, token)  # the session may be gone already: any reply will do
    harness.after_example()


def test_after_the_fuzz_only_the_bystanders_state_is_left(harness: Harness) -> None:
    """Last in the module: every fuzz session's memory, contexts and shares are gone."""
    bystander = harness.bystander
    bystander.check()
    mine = bystander.client.session_id
    status = bystander.client.status()
    for device in status["devices"]:
        leftovers = [s for s in device["sessions"] if s["session"] != mine and (s["allocations"] or s["bytes"]
                                                                                  or s["holds"])]
        assert leftovers == [], f"device {device['device']}: fuzz sessions left {leftovers}"
        assert not any(c["orphaned"] for c in device["contexts"]), device["contexts"]
        assert [s["owner"] for s in device["shares"]] == ([mine] if device["device"] == 1 else [])
    assert [s["name"] for s in bystander.client.list_shared()] == [SHARE_NAME]
    free = [int(bystander.client.memory_info(d)["device_free"]) for d in range(DEVICES)]
    assert free == bystander.device_free, "device memory did not come back after the fuzz sessions ended"
