"""Both clients' calls come from one definition each (client/api/calls.py): the same calls, the same parameters
(the family's classes apart), the docstring and signature shown where a user looks."""

from __future__ import annotations

import inspect
import pydoc
import re
from collections.abc import Callable
from typing import Any

from cuctxd.client import AsyncBuffer, AsyncClient, Buffer, Client
from cuctxd.client.api import async_client, calls, client
from cuctxd.client.api.flavours import AsyncCall, SyncCall

#: What one flavour alone has: an async client is opened after it is made (``await client.open()``).
ASYNC_ONLY = {"open"}


def public_calls(cls: type) -> dict[str, Callable[..., Any]]:
    return {name: member for name, member in inspect.getmembers(cls, callable) if not name.startswith("_")}


def shown(function: Callable[..., Any], family_names: dict[str, str]) -> str:
    """The signature as text, each class of the family named as the sync client's."""
    return re.sub(r"\b[A-Za-z]+\b", lambda word: family_names.get(word.group(), word.group()),
                  str(inspect.signature(function)))


def async_to_sync_names() -> dict[str, str]:
    """Each async class's name -> its sync twin's: the family's, and the pipeline's."""
    family = {async_name: client.FAMILY.names()[variable]
              for variable, async_name in async_client.FAMILY.names().items()}
    return {**family, "AsyncPipeline": "Pipeline"}


def test_both_clients_offer_the_same_calls_with_the_same_parameters() -> None:
    sync, awaited = public_calls(Client), public_calls(AsyncClient)
    assert sorted(sync) == sorted(set(awaited) - ASYNC_ONLY)
    names = async_to_sync_names()
    assert names["AsyncBuffer"] == "Buffer" and names["AsyncOpenedShare"] == "OpenedShare"
    for name in sync:
        assert shown(awaited[name], names) == shown(sync[name], {}), name


def made_from(cls: type) -> dict[str, Callable[..., Any]]:
    """The class's methods made from a definition in calls.py, by name: the definition."""
    return {name: member.__wrapped__ for name, member in vars(cls).items()
            if getattr(getattr(member, "__wrapped__", None), "__module__", None) == calls.__name__}


def test_every_definition_is_a_call_of_both_clients_under_its_own_name() -> None:
    definitions = {name: member for name, member in vars(calls).items()
                   if inspect.isfunction(member) and member.__module__ == calls.__name__}
    assert len(definitions) >= 40
    assert made_from(Client) == made_from(AsyncClient) == definitions


def test_the_methods_show_the_definitions_signature_and_docstring() -> None:
    assert Client.alloc.__doc__ == AsyncClient.alloc.__doc__ == calls.alloc.__doc__
    assert str(inspect.signature(Client.alloc)) == (
        "(self, size: 'int', device: 'int | None' = None, *, shareable: 'bool' = False) -> 'Buffer'")
    assert str(inspect.signature(AsyncClient.free)) == "(self, buffer: 'AsyncBuffer') -> 'None'"
    assert str(inspect.signature(Client.lookup)).endswith("-> 'ShareDescriptor'")
    assert str(inspect.signature(Client.context_stack)) == "(self, device: 'int | None' = None) -> 'list[Context]'"
    page = pydoc.render_doc(Client.alloc, renderer=pydoc.plaintext)
    assert "alloc(self, size: 'int', device: 'int | None' = None, *, shareable: 'bool' = False)" in page
    assert "stream-ordered pool" in page
    assert Client.alloc.__qualname__ == "Client.alloc" and AsyncClient.alloc.__qualname__ == "AsyncClient.alloc"


def test_sync_calls_are_plain_functions_and_async_ones_coroutine_functions() -> None:
    for name in made_from(Client):
        assert inspect.isfunction(vars(Client)[name]) and not inspect.iscoroutinefunction(vars(Client)[name]), name
        assert inspect.iscoroutinefunction(vars(AsyncClient)[name]), name
    assert not isinstance(vars(Client)["alloc"], SyncCall) and not isinstance(vars(AsyncClient)["alloc"], AsyncCall)


def test_the_families_build_each_flavours_own_classes() -> None:
    assert client.FAMILY.buffer is Buffer and async_client.FAMILY.buffer is AsyncBuffer
