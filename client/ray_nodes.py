"""cuctxd on Ray (``pip install 'cuctxd[ray]'``): one daemon per node, reached from tasks and actors.

Every node of the cluster runs its own cuctxd (on Kubernetes, the DaemonSet of ``deploy/kubernetes/``);
nothing here runs a daemon or adds a cluster layer: Ray's own scheduling pins one task to each node.

**Reaching the node's daemon** (:func:`node_endpoint`): ``$CUCTXD_ENDPOINT`` in the worker's
environment, else the DaemonSet's socket, ``ipc:///run/cuctxd/cuctxd.sock``, where it exists, else
the client's per-user default. A Ray node started with ``CUCTXD_ENDPOINT`` in its environment (a
KubeRay pod's ``env``, or ``CUCTXD_ENDPOINT=... ray start``) hands it to every worker it starts.
On a real cluster that is one socket path, the same on every node; several Ray nodes on one machine
(``ray.cluster_utils.Cluster``, as the tests do) each need their own, given per node.

**Publishing everywhere** (:func:`publish_on_every_node`): one task per alive node, pinned there
with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``, loads a checkpoint into that node's daemon as
``cuctx load`` does: a ``.safetensors`` file, or a directory (through its index, else every shard) as one
persistent layout with a copy on every GPU of the node (or the devices given); a directory of
tensor-parallel ranks (vLLM's ``sharded_state``) as one layout per rank. The path must be readable
on every node (a shared file system, or the same path baked into each node's image). Each node's
outcome comes back as a :class:`NodeResult`; a node without a daemon reports ``NoDaemon``, one
that does not finish within ``timeout`` reports ``Timeout`` and its task is cancelled: the call
never hangs.

**Opening locally** (:class:`LocalLayouts`): in a task or actor, the layouts of the node's own
daemon as one mapping of zero-copy tensors, held open while the object lives: each the copy on the actor's own
GPU (the one Ray gave it, matched by UUID whatever ``CUDA_VISIBLE_DEVICES`` renumbers).

Only the client library's public names are used, and the tensor functions named in :func:`_tensor_io`
and :func:`layout_names`. Formerly ``cuctxd.ray``: a ``ray.py`` at the repository's root, which
shadowed the real Ray wherever that root was on ``sys.path`` (the sessions it opens keep that name).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cuctxd import BadArgument, Client, CuctxError, NotFound
from cuctxd.protos.endpoints import ENDPOINT_ENV

__all__ = [
    "NODE_SOCKET", "LocalLayouts", "NodeResult", "layout_names", "node_client", "node_endpoint",
    "publish_on_every_node", "unpublish_on_every_node",
]

#: Where the Kubernetes DaemonSet (deploy/kubernetes/) puts each node's socket: a hostPath directory
#: that client pods mount at the same path.
NODE_SOCKET = "/run/cuctxd/cuctxd.sock"
#: Seconds :func:`publish_on_every_node` waits for all nodes together by default.
DEFAULT_TIMEOUT = 600.0


def _tensor_io() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``load_safetensors``, ``load_ranks`` and ``open_tensors``, imported on first use (a task that only reaches
    its node's daemon need not load the tensor adapters)."""
    from cuctxd.client.tensors import open_tensors
    from cuctxd.client.tensors.ranks import load_ranks
    from cuctxd.client.tensors.safetensors_load import load_safetensors

    return load_safetensors, load_ranks, open_tensors


def _ray() -> Any:
    try:
        import ray
    except ImportError as missing:
        raise ImportError(f"cuctxd.client.ray_nodes needs Ray: pip install 'cuctxd[ray]' ({missing})") from None
    return ray


# --- this node's daemon ------------------------------------------------------------------------


def node_endpoint() -> str:
    """The endpoint of the daemon on this node: ``$CUCTXD_ENDPOINT``, else ``ipc://`` + :data:`NODE_SOCKET`
    where that socket exists, else the client's default (its per-user socket)."""
    explicit = os.environ.get(ENDPOINT_ENV)
    if explicit:
        return explicit
    if os.path.exists(NODE_SOCKET):
        return f"ipc://{NODE_SOCKET}"
    from cuctxd.protos.endpoints import default_endpoint

    return default_endpoint()


def node_client(**options: Any) -> Client:
    """A :class:`~cuctxd.Client` session with this node's daemon (:func:`node_endpoint`); ``options``
    as for ``Client``. Raises :class:`~cuctxd.NoDaemon` at once when none listens there."""
    return Client(node_endpoint(), **options)


def layout_names(path: str | os.PathLike[str], name: str) -> list[str]:
    """The layouts :func:`publish_on_every_node` makes of ``path``: ``name`` for a file or a directory (its index,
    else every shard, as one layout); ``name/rank-R`` for each rank of a directory of tensor-parallel ranks."""
    from cuctxd.client.tensors.checkpoints import tensor_parallel_ranks
    from cuctxd.client.tensors.ranks import rank_name

    ranks = tensor_parallel_ranks(os.fspath(path))
    return [rank_name(name, rank) for rank in ranks] if ranks else [name]


# --- per-node outcomes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeResult:
    """What one node's task did. ``error_type`` names the failure (a cuctxd error's class, e.g.
    ``NoDaemon``, ``NameExists``, ``DaemonTimeout``; ``Timeout`` when the task did not finish in time;
    ``TaskFailed`` when Ray lost it or it raised something else) and ``error`` says more; both are
    None on success."""

    node_id: str
    address: str
    endpoint: str | None = None
    layouts: tuple[str, ...] = ()
    nbytes: int = 0
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _failure(error: BaseException) -> dict[str, Any]:
    return {"error_type": type(error).__name__, "error": str(error)}


def _publish_here(path: str, name: str, device: int | Sequence[int] | str | None, read_only: bool, replace: bool,
                  timeout: float) -> dict[str, Any]:
    """On one node: every layout of ``path`` into the node's daemon, on ``device`` (``"all"``: a copy on each of
    its GPUs), or none (a node's ranks are all loaded or none)."""
    load_safetensors, load_ranks, _ = _tensor_io()
    endpoint = node_endpoint()
    try:
        layouts = layout_names(path, name)
        with Client(endpoint, timeout=timeout, name="cuctxd.ray publish") as client:
            devices = list(range(len(client.devices()))) if device == "all" else device
            if layouts == [name]:
                loaded = [load_safetensors(client, path, name, device=devices, read_only=read_only, replace=replace)]
            else:
                loaded = load_ranks(client, path, name, devices=None if device == "all" else devices,
                                    read_only=read_only, replace=replace)
    except (CuctxError, OSError) as error:
        return {"endpoint": endpoint, **_failure(error)}
    return {"endpoint": endpoint, "layouts": tuple(layouts), "nbytes": sum(one.descriptor.size for one in loaded)}


def _unpublish_here(names: Sequence[str], timeout: float) -> dict[str, Any]:
    """On one node: unpublish ``names`` from the node's daemon; a name it does not know is skipped."""
    endpoint = node_endpoint()
    removed = []
    try:
        with Client(endpoint, timeout=timeout, name="cuctxd.ray unpublish") as client:
            for layout in names:
                if _unpublish_quietly(client, layout):
                    removed.append(layout)
    except CuctxError as error:
        return {"endpoint": endpoint, **_failure(error)}
    return {"endpoint": endpoint, "layouts": tuple(removed)}


def _unpublish_quietly(client: Client, name: str) -> bool:
    """Unpublish ``name``; False when the daemon does not know it."""
    try:
        client.unpublish(name)
    except NotFound:
        return False
    return True


# --- every node ---------------------------------------------------------------------------------


def alive_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()`` of the connected cluster that are alive."""
    return [node for node in _ray().nodes() if node.get("Alive")]


def _on_every_node(task: Callable[..., dict[str, Any]], args: tuple[Any, ...], timeout: float,
                   node_ids: Sequence[str] | None) -> list[NodeResult]:
    """Run ``task(*args)`` once on each alive node (or those of ``node_ids``), pinned there; one result
    per node, in ``ray.nodes()`` order, within ``timeout`` seconds: a task not done by then is
    cancelled and reported as ``Timeout``."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = alive_nodes()
    if node_ids is not None:
        wanted = set(node_ids)
        nodes = [node for node in nodes if node["NodeID"] in wanted]
    remote = ray.remote(num_cpus=0, max_retries=0)(task)
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                           name=f"{task.__name__}@{node['NodeManagerAddress']}").remote(*args)
            for node in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    finished = set(ready)
    results = []
    for node, ref in zip(nodes, refs, strict=True):
        where = {"node_id": node["NodeID"], "address": node["NodeManagerAddress"]}
        if ref not in finished:
            ray.cancel(ref, force=True)
            results.append(NodeResult(**where, error_type="Timeout",
                                      error=f"no answer from the node's task within {timeout:g} s (cancelled)"))
            continue
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as error:
            results.append(NodeResult(**where, error_type="TaskFailed", error=str(error)))
            continue
        results.append(NodeResult(**where, **outcome))
    return results


def publish_on_every_node(path: str | os.PathLike[str], name: str, *, device: int | Sequence[int] | str = "all",
                          read_only: bool = False, replace: bool = False, timeout: float = DEFAULT_TIMEOUT,
                          node_ids: Sequence[str] | None = None) -> list[NodeResult]:
    """Load ``path`` (a ``.safetensors`` file, a directory through its index, or of tensor-parallel ranks) into the
    daemon of every alive node of the connected Ray cluster (``ray.init`` first), as the persistent layouts
    :func:`layout_names` gives: with a copy on ``device`` (``"all"``, the default: every GPU of the node, filled
    from the first on the GPU; a device or a list of them; ranks: rank R on device R), ``read_only`` for
    consumers.

    One task per node, pinned with ``NodeAffinitySchedulingStrategy(soft=False)``; ``path`` is read on
    each node. Returns one :class:`NodeResult` per node: a node either holds all the layouts or none.
    A name that holds the same content already is left as it is; other content fails that node with
    ``NameExists`` unless ``replace`` (which swaps the name in one step; sessions that hold the old layout
    keep it). Every node answers within ``timeout`` seconds
    or is reported as ``Timeout``. ``node_ids``: only these nodes (``ray.nodes()``'s ``NodeID``).
    """
    return _on_every_node(_publish_here, (os.fspath(path), name, device, read_only, replace, timeout), timeout,
                          node_ids)


def unpublish_on_every_node(names: Sequence[str], *, timeout: float = 60.0,
                            node_ids: Sequence[str] | None = None) -> list[NodeResult]:
    """Unpublish ``names`` (e.g. :attr:`NodeResult.layouts`) from every alive node's daemon; each
    result's ``layouts`` lists those that node had."""
    return _on_every_node(_unpublish_here, (list(names), timeout), timeout, node_ids)


# --- opening on this node ------------------------------------------------------------------------


class LocalLayouts(Mapping[str, Any]):
    """Layouts of this node's daemon, opened in a task or actor: one mapping, tensor name -> zero-copy
    tensor (``__cuda_array_interface__`` on a GPU, numpy's array interface on the sim), over all of them.

    ``names``: a layout name, or several (:attr:`NodeResult.layouts`). Each is opened on the actor's GPU (or
    ``device``, the daemon's ordinal): :class:`~cuctxd.NoCopy` where it has no copy there. One session with
    the node's daemon holds them open until :meth:`close` (or the end of a ``with`` block): keep the
    object as long as the tensors are used. ``writable``: map them for writing (refused for read-only
    names). Raises :class:`~cuctxd.NoDaemon` without a daemon on the node, :class:`~cuctxd.NotFound`
    for a name it does not know, and :class:`~cuctxd.BadArgument` when two layouts hold a tensor of
    the same name.
    """

    def __init__(self, names: str | Sequence[str], *, writable: bool = False, endpoint: str | None = None,
                 timeout: float = 30.0, device: int | None = None) -> None:
        _, _, open_tensors = _tensor_io()
        self.client = Client(endpoint or node_endpoint(), timeout=timeout, name="cuctxd.ray layouts")
        self.layouts: dict[str, Any] = {}
        self._tensors: dict[str, Any] = {}
        try:
            for layout in [names] if isinstance(names, str) else names:
                opened = self.layouts[layout] = open_tensors(self.client, layout, writable=writable, device=device)
                for key in opened:
                    if key in self._tensors:
                        raise BadArgument(f"tensor {key!r} is in more than one of the layouts {list(self.layouts)}")
                    self._tensors[key] = opened[key]
        except BaseException:
            self.close()
            raise

    def __getitem__(self, key: str) -> Any:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def close(self) -> None:
        """Close every layout and the session (the daemon keeps the persistent layouts)."""
        self._tensors.clear()
        for opened in self.layouts.values():
            opened.close()
        self.layouts.clear()
        self.client.close()

    def __enter__(self) -> LocalLayouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

