"""A client as the data plane sees it: the typed interface its functions and objects take instead of the client classes.

The data plane sits below :mod:`cuctxd.client.api` and never imports it; its functions
(:mod:`~cuctxd.client.data_plane.transfers`, :func:`~cuctxd.client.data_plane.host_buffers.host_alloc`) take
an :data:`Owner`, a client of either flavour (they only build plans), and the objects that run requests of their
own (buffers, host buffers, contexts, streams, shares) a :class:`SyncOwner` or an :class:`AsyncOwner`: the session
protocols of :mod:`cuctxd.client.wire.session` with the data plane added. mypy checks that
:class:`~cuctxd.client.api.client.Client` and :class:`~cuctxd.client.api.async_client.AsyncClient` satisfy them.
"""

from __future__ import annotations

from typing import Literal, Protocol, overload

from cuctxd.client.data_plane.plane import DataPlane
from cuctxd.client.wire.session import AsyncSession, Session


class PlaneOwner(Protocol):
    """A client of either flavour as far as its data plane goes (:meth:`Client.data_plane
    <cuctxd.client.api.client.Client.data_plane>`)."""

    @overload
    def data_plane(self, *, required: Literal[True] = True) -> DataPlane: ...

    @overload
    def data_plane(self, *, required: bool) -> DataPlane | None: ...


class SyncOwner(PlaneOwner, Session, Protocol):
    """A sync client: ``run`` answers on the caller's thread."""


class AsyncOwner(PlaneOwner, AsyncSession, Protocol):
    """An async client: ``run`` is awaited."""


#: A client of either flavour.
Owner = SyncOwner | AsyncOwner
