"""SortedNames (the chunked sorted set ``list_shared`` pages through) against a plain set, sorted."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuctxd.daemon.registry import sorted_names
from cuctxd.daemon.registry.sorted_names import SortedNames

names = st.text(alphabet="ab\u00e9\U0001f600", max_size=4)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 to 4 names, so that a few dozen names split and empty chunks many times over."""
    monkeypatch.setattr(sorted_names, "CHUNK", 2)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), names), max_size=80), start=names, inclusive=st.booleans())
def test_adds_and_discards_keep_the_model_order(steps: list[tuple[bool, str]], start: str, inclusive: bool) -> None:
    index, model = SortedNames(), set()
    for adding, name in steps:
        if adding:
            index.add(name)
            model.add(name)
        else:
            index.discard(name)
            model.discard(name)
        assert len(index) == len(model)
    assert list(index) == sorted(model)
    assert all(name in index for name in model) and "not-there" not in index and 7 not in index
    expected = [name for name in sorted(model) if (name >= start if inclusive else name > start)]
    assert list(index.from_name(start, inclusive=inclusive)) == expected


def test_many_names_in_random_order_come_out_sorted_and_go_again() -> None:
    rng = random.Random(7)
    words = [f"{rng.randrange(10**6):06d}-{n}" for n in range(2000)]
    index = SortedNames(words)
    assert list(index) == sorted(words) and len(index) == 2000
    assert list(index.from_name(sorted(words)[1000], inclusive=False)) == sorted(words)[1001:]
    rng.shuffle(words)
    for word in words[:1500]:
        index.discard(word)
    assert list(index) == sorted(words[1500:])
    index.clear()
    assert list(index) == [] and list(index.from_name("", inclusive=True)) == []
