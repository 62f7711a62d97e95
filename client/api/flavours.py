"""How one definition of a call becomes a method of both clients: :class:`SyncCall` and :class:`AsyncCall`.

A call is defined once in :mod:`cuctxd.client.api.calls`: a function of the client, its :class:`Family`
(the classes that flavour builds: ``Buffer`` or ``AsyncBuffer``, ...) and the caller's arguments, with the
docstring, that returns the :class:`~cuctxd.client.wire.build.Request` or plan to run.
``alloc = SyncCall(calls.alloc, FAMILY)`` in :class:`~cuctxd.client.api.client.Client` makes it a method that
returns ``self.run(...)``; ``AsyncCall`` in :class:`~cuctxd.client.api.async_client.AsyncClient` a coroutine
method that returns ``await self.run(...)``. Nothing else differs.

mypy sees each method with the definition's own parameters and answer, the family's classes put in for its
type variables (``Client.alloc(...) -> Buffer``, ``AsyncClient.alloc(...) -> Coroutine[..., AsyncBuffer]``),
through the descriptors' ``__get__``. At run time the class holds a plain function instead (put there when the
class is made), named after the definition, with its docstring and a ``__signature__`` (what ``help`` and
:func:`inspect.signature` show) that is the definition's, with ``self`` for the client and the family's class
names for its type variables.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from cuctxd.client.wire.build import FromWire, Plan, Request

P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C")
# Covariant, so that a definition names the classes it does not use ``object``; the definitions' own type
# variables (calls.py: same names, bound to each kind's base) cannot be covariant, being parameters' types.
ContextT = TypeVar("ContextT", covariant=True)
BufferT = TypeVar("BufferT", covariant=True)
StreamT = TypeVar("StreamT", covariant=True)
EventT = TypeVar("EventT", covariant=True)
ShareT = TypeVar("ShareT", covariant=True)
HostT = TypeVar("HostT", covariant=True)


@dataclass(frozen=True)
class Family(Generic[ContextT, BufferT, StreamT, EventT, ShareT, HostT]):
    """The classes one flavour's calls build. A definition names the ones it uses as type variables
    (``Family[object, BufferT, object, ...]``), which the class's family fills in."""

    context: FromWire[ContextT]
    buffer: FromWire[BufferT]
    stream: FromWire[StreamT]
    event: FromWire[EventT]
    share: type[ShareT]
    host: type[HostT]

    def names(self) -> dict[str, str]:
        """Each field's type variable's name (``BufferT``) -> its class's name (``Buffer``)."""
        return {f"{field.name.capitalize()}T": getattr(self, field.name).__name__ for field in fields(self)}


F = TypeVar("F", bound=Family[Any, Any, Any, Any, Any, Any])


#: ``Request[X]``, ``Plan[X]`` or ``Request[X] | Plan[X]`` as a definition's annotation says it: the X.
_RUNS = re.compile(r"^(?:Request|Plan)\[(?P<answer>.*?)\](?: \| Plan\[(?P=answer)\])?$")


def _shown(annotation: Any, names: dict[str, str]) -> Any:
    """A definition's annotation (a string: ``from __future__ import annotations``) as the method shows it."""
    if not isinstance(annotation, str):
        return annotation
    runs = _RUNS.match(annotation)
    text = runs.group("answer") if runs else annotation
    return re.sub(r"\b[A-Z][A-Za-z]*T\b", lambda name: names.get(name.group(), name.group()), text)


def _signature(definition: Callable[..., Any], family: Family[Any, Any, Any, Any, Any, Any]) -> inspect.Signature:
    """The method's signature: the definition's, ``self`` for its client and family, the family's class names."""
    names = family.names()
    client, _family, *arguments = inspect.signature(definition).parameters.values()
    shown = [client.replace(name="self", annotation=inspect.Parameter.empty)]
    shown += [argument.replace(annotation=_shown(argument.annotation, names)) for argument in arguments]
    return inspect.Signature(shown, return_annotation=_shown(inspect.signature(definition).return_annotation, names))


class _Method:
    """What both descriptors hold: the method made from a definition, named after it and the class it is in."""

    def __init__(self, method: Callable[..., Any], definition: Callable[..., Any],
                 family: Family[Any, Any, Any, Any, Any, Any]) -> None:
        functools.update_wrapper(method, definition)  # its name, its docstring, __wrapped__: the definition
        method.__signature__ = _signature(definition, family)  # type: ignore[attr-defined]  # what help() shows
        self.method = method

    def __set_name__(self, owner: type, name: str) -> None:
        """Put the method itself in the class: an access then costs what a hand-written method's does."""
        self.method.__qualname__ = f"{owner.__qualname__}.{name}"
        self.method.__module__ = owner.__module__
        setattr(owner, name, self.method)


class SyncCall(_Method, Generic[C, P, T]):
    """A call of the sync client: runs the definition's request or plan with ``self.run`` and returns the answer."""

    def __init__(self, definition: Callable[Concatenate[C, F, P], Request[T] | Plan[T]], family: F) -> None:
        def method(client: Any, /, *args: Any, **kwargs: Any) -> Any:
            return client.run(definition(client, family, *args, **kwargs))

        super().__init__(method, definition, family)

    if TYPE_CHECKING:  # what mypy sees of the method the class holds
        @overload
        def __get__(self, client: None, owner: type) -> Callable[Concatenate[C, P], T]: ...

        @overload
        def __get__(self, client: C, owner: type) -> Callable[P, T]: ...

        def __get__(self, client: Any, owner: type) -> Any: ...


class AsyncCall(_Method, Generic[C, P, T]):
    """A call of the async client: a coroutine that awaits ``self.run`` with the definition's request or plan."""

    def __init__(self, definition: Callable[Concatenate[C, F, P], Request[T] | Plan[T]], family: F) -> None:
        async def method(client: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await client.run(definition(client, family, *args, **kwargs))

        super().__init__(method, definition, family)

    if TYPE_CHECKING:  # what mypy sees of the method the class holds
        @overload
        def __get__(self, client: None, owner: type) -> Callable[Concatenate[C, P], Coroutine[Any, Any, T]]: ...

        @overload
        def __get__(self, client: C, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...

        def __get__(self, client: Any, owner: type) -> Any: ...
