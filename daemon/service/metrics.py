"""The opt-in Prometheus endpoint (``metrics_port``): requests, latency, sessions, devices.

Needs the ``metrics`` extra (``pip install 'cuctxd[metrics]'``, i.e.
prometheus-client). Counters and the latency histogram are fed by the front
thread through :class:`cuctxd.daemon.intake.observe.RequestObserver`. Per-device numbers are
read at scrape time by asking each device worker, through its queue, for a
snapshot of its :class:`DeviceState`: the HTTP thread never calls the driver
nor reads worker-owned state itself. A worker busy for longer than
:data:`SCRAPE_TIMEOUT` is reported with ``cuctxd_device_up 0`` for that scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cuctxd.daemon import __version__
from cuctxd.daemon.device.status import memory_status
from cuctxd.protos.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from cuctxd.daemon.device.state import DeviceState
    from cuctxd.daemon.registry.daemon_state import DaemonState
    from cuctxd.daemon.worker.loop import DeviceWorker

log = logging.getLogger(__name__)

#: Seconds a scrape waits for each device worker's snapshot.
SCRAPE_TIMEOUT = 1.0
#: Latency buckets, seconds: from a front-answered ping to a large copy.
LATENCY_BUCKETS = (0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricsUnavailable(RuntimeError):
    """metrics_port is set but prometheus-client is not installed."""


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MetricsUnavailable(
            "metrics_port is set but prometheus-client is not installed: pip install 'cuctxd[metrics]'"
        ) from exc
    return prometheus_client


class DaemonMetrics:
    """The daemon's own registry (not prometheus-client's global one) and the front-fed series."""

    def __init__(self) -> None:
        prom = _prometheus()
        prom.disable_created_metrics()
        self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter(
            "cuctxd_requests", "Requests answered, by op and outcome ('ok' or the error name).",
            ["op", "outcome"], registry=self.registry)
        self.latency = prom.Histogram(
            "cuctxd_request_duration_seconds",
            "From a request's arrival at the front to its reply leaving, by op.",
            ["op"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.sessions_opened = prom.Counter("cuctxd_sessions_opened", "Sessions opened (hello).",
                                            registry=self.registry)
        self.sessions_closed = prom.Counter("cuctxd_sessions_closed", "Sessions closed by their client (goodbye).",
                                            registry=self.registry)
        self.sessions_reaped = prom.Counter("cuctxd_sessions_reaped",
                                            "Sessions reaped because their lease ran out.", registry=self.registry)
        prom.ProcessCollector(registry=self.registry)
        self._requests: dict[tuple[str, str], Any] = {}
        self._latency: dict[str, Any] = {}
        self._server: Any = None

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        """One finished request; any thread (``labels`` gives every caller the same child series)."""
        counter = self._requests.get((op, outcome))
        if counter is None:
            counter = self._requests[(op, outcome)] = self.requests.labels(op, outcome)
        counter.inc()
        histogram = self._latency.get(op)
        if histogram is None:
            histogram = self._latency[op] = self.latency.labels(op)
        histogram.observe(seconds)

    def watch(self, state: DaemonState, workers: Sequence[DeviceWorker], ordinals: Sequence[int]) -> None:
        """Add the series read at scrape time: sessions, draining, and each device's snapshot."""
        self.registry.register(_StateCollector(state, workers, ordinals))

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint on its own daemon thread; returns its URL. OSError if the port is taken."""
        self._server, _ = _prometheus().start_http_server(port, addr=host, registry=self.registry)
        bound_host, bound_port = self._server.server_address[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        return f"http://{shown}:{bound_port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def device_snapshot(state: DeviceState) -> dict[str, Any]:
    """Worker thread: the numbers the metrics show for one device.

    ``memory_free``/``memory_used`` are the driver's ``cuMemGetInfo`` (the whole
    device, every process), read only while the daemon already has a context on
    the device (:func:`cuctxd.daemon.device.status.memory_status`).
    """
    contexts = state.live_contexts()
    memory = memory_status(state, contexts)
    snapshot: dict[str, Any] = {
        "contexts": len(contexts),
        "sessions": len(state.sessions),
        "allocations": sum(len(s.buffers) for s in state.sessions.values()),
        "allocated_bytes": sum(s.bytes_allocated for s in state.sessions.values()),
        "shares": len(state.sharing.shares),
        "shm_lanes": len(state.shm_lanes),
        "memory_total": memory["total"],
    }
    if memory["free"] is not None:
        snapshot.update(memory_free=memory["free"], memory_used=memory["used"])
    return snapshot


def ask_worker(worker: DeviceWorker, work: Callable[[DeviceState], Any]) -> Callable[[float], Any]:
    """Queue ``work`` on ``worker``; the returned function waits up to its argument (s) for the result."""
    done = threading.Event()
    box: list[Any] = []

    def run(state: DeviceState) -> None:
        try:
            box.append(work(state))
        finally:
            done.set()

    worker.run(run)

    def wait(timeout: float) -> Any:
        return box[0] if done.wait(timeout) and box else None

    return wait


class _StateCollector:
    """Scrape-time series; runs on the HTTP server's threads."""

    def __init__(self, state: DaemonState, workers: Sequence[DeviceWorker], ordinals: Sequence[int]) -> None:
        self._state = state
        self._workers = workers
        self._ordinals = ordinals

    def describe(self) -> list[Any]:
        return []  # unchecked collector: the series depend on the devices

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        state = self._state
        node = state.config.node_name
        info = GaugeMetricFamily("cuctxd_info", "The daemon's version, protocol, backend and node.",
                                 labels=["version", "protocol", "backend", "node"])
        info.add_metric([__version__, str(PROTOCOL_VERSION), state.backend, node], 1)
        yield info
        yield GaugeMetricFamily("cuctxd_sessions", "Open sessions.", value=len(state.sessions))
        yield GaugeMetricFamily("cuctxd_draining", "1 while shutting down.", value=int(state.draining))
        yield from _fd_families(state)
        depths = [worker.queue_depth() for worker in self._workers]  # before the snapshots join the queues
        waits = [ask_worker(worker, device_snapshot) for worker in self._workers]
        deadline = time.monotonic() + SCRAPE_TIMEOUT
        families = {
            name: GaugeMetricFamily(f"cuctxd_device_{name}", text, labels=["device"])
            for name, text in (
                ("up", "1 if the device's worker answered this scrape in time."),
                ("queue_depth", "Work items queued on the device's worker."),
                ("contexts", "Contexts alive on the device (the primary counted once)."),
                ("sessions", "Sessions with state on the device."),
                ("allocations", "Allocations held by sessions."),
                ("allocated_bytes", "Bytes allocated by sessions through the daemon."),
                ("shares", "Exported allocations alive on the device."),
                ("shm_lanes", "Sessions' shm lanes open to the device."),
                ("memory_total_bytes", "Device memory."),
                ("memory_free_bytes", "cuMemGetInfo free memory (whole device; only while a context lives)."),
                ("memory_used_bytes", "Total minus free memory (whole device; only while a context lives)."),
            )
        }
        device_info = GaugeMetricFamily("cuctxd_device_info",
                                        "A served device: its driver ordinal and identity, and the node.",
                                        labels=["device", "ordinal", "name", "uuid", "pci_bus_id", "node"])
        for index, (device, wait) in enumerate(zip(state.devices, waits, strict=True)):
            label = [str(index)]
            device_info.add_metric([str(index), str(self._ordinals[index]), device.name, device.uuid,
                                    device.pci_bus_id, node], 1)
            families["queue_depth"].add_metric(label, depths[index])
            families["memory_total_bytes"].add_metric(label, device.total_memory)
            snapshot = wait(max(0.0, deadline - time.monotonic()))
            families["up"].add_metric(label, 0 if snapshot is None else 1)
            if snapshot is None:
                continue
            for name in ("contexts", "sessions", "allocations", "allocated_bytes", "shares", "shm_lanes"):
                families[name].add_metric(label, snapshot[name])
            if "memory_free" in snapshot:
                families["memory_free_bytes"].add_metric(label, snapshot["memory_free"])
                families["memory_used_bytes"].add_metric(label, snapshot["memory_used"])
        yield device_info
        yield from families.values()


def _fd_families(state: DaemonState) -> Iterator[Any]:
    """The fd budget and the fd channel's connections (any thread: both read under their own locks)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if state.fd_budget is not None:
        budget = state.fd_budget.to_status()
        yield GaugeMetricFamily("cuctxd_client_fds", "Fds the daemon holds for clients (tickets, shm lanes, host "
                                                     "buffers, fd channel connections).", value=budget["held"])
        yield CounterMetricFamily("cuctxd_client_fds_refused", "Requests and connections refused for lack of "
                                                               "fd budget (any share).", value=budget["refused"])
        if "max" in budget:
            yield GaugeMetricFamily("cuctxd_client_fds_max", "max_client_fds in effect.", value=budget["max"])
            yield GaugeMetricFamily("cuctxd_client_fds_max_per_peer", "max_client_fds_per_peer in effect.",
                                    value=budget["max_per_peer"])
            yield GaugeMetricFamily("cuctxd_open_files_limit", "The daemon's open-file limit (RLIMIT_NOFILE).",
                                    value=budget["open_files"])
        largest = budget["top_peers"][0]["held"] if budget["top_peers"] else 0
        yield GaugeMetricFamily("cuctxd_client_fds_largest_peer", "Fds held for the peer holding the most.",
                                value=largest)
    if state.fd_channel is not None:
        channel = state.fd_channel.stats()
        yield GaugeMetricFamily("cuctxd_fd_channel_connections", "Connections open to the fd channel.",
                                value=channel["connections"])
        yield CounterMetricFamily("cuctxd_fd_channel_refused", "fd channel connections refused at a limit.",
                                  value=channel["refused"])
