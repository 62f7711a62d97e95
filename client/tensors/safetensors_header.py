"""The JSON of a safetensors header and of a checkpoint's index, read by their grammar alone.

A shard's header is UTF-8 JSON: one object whose members are tensors (``{"dtype": str, "shape": [int, ...],
"data_offsets": [int, int]}``) and at most one ``__metadata__`` (an object of strings, or null); an index is
``{"weight_map": {tensor: file}, "metadata": {key: scalar}}``. ``json.loads`` would first build whatever the
bytes describe (a million empty tensors: a gigabyte of dicts; a list nested 100,000 deep: a RecursionError)
and leave the checks for after. This parser reads that grammar and nothing else, so anything else is refused
at its first byte, nothing nests deeper than the grammar, a tensor costs at most ``MAX_DIMS`` integers and a
name of ``MAX_NAME_CHARS``, and the tensors stop at the caller's limit. The bytes are read only as far as
the parse has got, so a header refused early costs what came before the refusal. Integers are JSON's
without sign, fraction or exponent (safetensors reads them as u64: at most 20 digits); a key twice in one
object is refused, and so is a tensor key other than those three (safetensors' own reader ignores them; no
writer makes them); an index's metadata holds scalars only. Every refusal is
:class:`~cuctxd.protos.errors.BadArgument` naming the file and the byte. Which thread may call: any (it only
reads the bytes it is given).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

from cuctxd.protos.errors import BadArgument
from cuctxd.protos.layouts import MAX_DIMS, MAX_NAME_CHARS, MAX_TENSORS

_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)"')
_U64 = rb"(?:0|[1-9][0-9]{0,19})"
_U64_LIST = re.compile(rb"\[[ \t\n\r]*(?:%s[ \t\n\r]*(?:,[ \t\n\r]*%s[ \t\n\r]*){0,%d})?\]"
                       % (_U64, _U64, MAX_DIMS - 1))
_DIGITS = re.compile(rb"[0-9]+")
#: A tensor as writers lay it out (dtype, shape, data_offsets; at most a space after ``:`` and ``,``): read
#: in one match, at most :data:`_WRITTEN_BYTES` long; any other layout is read key by key.
_WRITTEN = re.compile(rb'\{"dtype": ?"([A-Z0-9_]{1,16})", ?"shape": ?(\[(?:%s(?:, ?%s){0,%d})?\]), ?'
                      rb'"data_offsets": ?\[(%s), ?(%s)\]\}' % (_U64, _U64, MAX_DIMS - 1, _U64, _U64))
_WRITTEN_BYTES = 1024
#: An index's metadata numbers: integers of at most 18 digits (so that msgpack carries them), or floats.
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,400})?(?:[eE][+-]?[0-9]{1,4})?")
_NULL = re.compile(b"null")
_LITERALS = {re.compile(b"true"): True, re.compile(b"false"): False, _NULL: None}
_SPACES = frozenset(b" \t\n\r")
#: The bytes of a header read before its parse starts; more are read, doubling, as the parse needs them.
FIRST_READ = 1 << 20
_TENSOR_KEYS = ("dtype", "shape", "data_offsets")

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor as its header states it: safetensors ``dtype`` code, ``shape``, ``data_offsets`` (begin, end)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _Reader:
    """A cursor over one JSON document, the ``what`` (header, index) of file ``path``: ``length`` bytes that
    ``read(n)`` gives in order, read only as far as the parse has got (doubling from :data:`FIRST_READ`), so
    that a header refused early costs only what was read before the refusal."""

    def __init__(self, path: str, what: str, read: Callable[[int], bytes], length: int) -> None:
        self.path, self.what, self._read, self._length = path, what, read, length
        self.data, self.pos = b"", 0
        self._more()

    def _more(self) -> None:
        """Read on: as many bytes again as are held (at least :data:`FIRST_READ`), up to the length."""
        want = min(self._length - len(self.data), max(len(self.data), FIRST_READ))
        chunk = self._read(want)
        if len(chunk) != want:
            raise BadArgument(f"{self.path}: truncated while it was read: the {self.what} has "
                              f"{len(self.data) + len(chunk)} of its {self._length} bytes")
        self.data += chunk

    def _match(self, pattern: re.Pattern[bytes]) -> re.Match[bytes] | None:
        """``pattern`` at the cursor, reading on while it fails or reaches the end of what is read (where it
        might go on)."""
        while True:
            match = pattern.match(self.data, self.pos)
            if len(self.data) == self._length or (match is not None and match.end() < len(self.data)):
                return match
            self._more()

    def refuse(self, problem: str) -> NoReturn:
        raise BadArgument(f"{self.path}: the {self.what} {problem} (at byte {self.pos} of it)")

    def expected(self, what: str) -> NoReturn:
        found = repr(self.data[self.pos:self.pos + 16].decode("utf-8", "replace")) if self.next() >= 0 else "its end"
        self.refuse(f"is not JSON of a safetensors {self.what}: expected {what}, found {found}")

    def next(self) -> int:
        """The next byte after whitespace (-1 at the end), not taken."""
        if self.pos < len(self.data) and self.data[self.pos] not in _SPACES:  # most often: no whitespace
            return self.data[self.pos]
        self.pos = self._match(_WHITESPACE).end()  # type: ignore[union-attr]  # ``*`` always matches
        return self.data[self.pos] if self.pos < len(self.data) else -1

    def take(self, char: bytes) -> bool:
        if self.next() != char[0]:
            return False
        self.pos += 1
        return True

    def literal(self, word: re.Pattern[bytes]) -> bool:
        """Whether ``word`` (``null``, ``true``, ``false``) comes next; taken if so."""
        self.next()
        match = self._match(word)
        if match is None:
            return False
        self.pos = match.end()
        return True

    def string(self, what: str) -> str:
        self.next()
        match = self._match(_STRING)
        if match is None:
            self.expected(what)
        raw = match.group(1)
        try:
            text = raw.decode("utf-8")
            if b"\\" in raw:
                text = str(json.loads(f'"{text}"'))  # its escapes, in a string of bounded size
            text.encode("utf-8")  # a lone surrogate (``\ud800``) is no Unicode text
        except UnicodeError:
            self.refuse("holds a string that is not UTF-8 text")
        self.pos = match.end()
        return text

    def members(self, what: str) -> Iterator[str]:
        """The keys of the object that comes next, each read after the caller has read the previous value."""
        if not self.take(b"{"):
            self.expected(what)
        seen: set[str] = set()
        if self.take(b"}"):
            return
        while True:
            at = self.pos
            key = self.string("a string (a key)")
            if key in seen:
                self.pos = at
                self.refuse(f"has the key {key[:80]!r} twice in one object")
            seen.add(key)
            if not self.take(b":"):
                self.expected("':'")
            yield key
            if self.take(b"}"):
                return
            if not self.take(b","):
                self.expected("',' or '}'")

    def integers(self, what: str) -> list[int]:
        self.next()
        match = self._match(_U64_LIST)
        if match is None:
            shown = self.data[self.pos:self.pos + 64].split(b"]")[0].decode("utf-8", "replace")
            self.refuse(f"says {what} {shown}], not a list of at most {MAX_DIMS} integers of 0 to 2^64-1")
        self.pos = match.end()
        return [int(digits) for digits in _DIGITS.findall(match.group())]

    def scalar(self) -> Scalar:
        if self.next() == ord('"'):
            return self.string("a string")
        for literal, value in _LITERALS.items():
            if self.literal(literal):
                return value
        match = self._match(_NUMBER)
        if match is None:
            self.expected("a string, a number, true, false or null")
        self.pos = match.end()
        token = match.group()
        return float(token) if any(c in token for c in b".eE") else int(token)

    def written(self) -> re.Match[bytes] | None:
        """A tensor entry laid out as writers do (:data:`_WRITTEN`), taken; None for any other."""
        self.next()
        while len(self.data) < min(self.pos + _WRITTEN_BYTES, self._length):
            self._more()
        match = _WRITTEN.match(self.data, self.pos)
        if match is not None:
            self.pos = match.end()
        return match

    def end(self) -> None:
        if self.next() >= 0:
            self.expected("the end")


def parse_header(path: str, read: Callable[[int], bytes], length: int,
                 limit: int) -> tuple[list[HeaderTensor], dict[str, str]]:
    """The tensors (in header order) and ``__metadata__`` of the ``length``-byte header of ``path`` that
    ``read(n)`` gives; more than ``limit`` tensors are refused as soon as the one past it is read."""
    reader = _Reader(path, "header", read, length)
    tensors: list[HeaderTensor] = []
    metadata: dict[str, str] = {}
    for name in reader.members("'{' (a safetensors file's header is a JSON object)"):
        if name == "__metadata__":
            if not reader.literal(_NULL):
                metadata = {key: reader.string("a string (__metadata__ maps strings to strings)")
                            for key in reader.members("'{' or null (__metadata__)")}
            continue
        if len(tensors) == limit:
            reader.refuse(f"lists more than {limit} tensors (a checkpoint holds at most {MAX_TENSORS}, all its "
                          "files together: one layout's)")
        if not 0 < len(name) <= MAX_NAME_CHARS:
            reader.refuse(f"names a tensor with {len(name)} characters ({name[:40]!r}...): a tensor's name has 1 "
                          f"to {MAX_NAME_CHARS}")
        tensors.append(_tensor(reader, name))
    reader.end()
    return tensors, metadata


def _tensor(reader: _Reader, name: str) -> HeaderTensor:
    written = reader.written()
    if written is not None:
        return HeaderTensor(name, written.group(1).decode(), tuple(int(n) for n in _DIGITS.findall(written.group(2))),
                            int(written.group(3)), int(written.group(4)))
    if reader.next() != ord("{"):
        reader.refuse(f"entry {name!r} is not a tensor (an object of dtype, shape, data_offsets)")
    fields: dict[str, str | list[int]] = {}
    for key in reader.members("'{'"):
        if key == "dtype":
            fields[key] = reader.string(f"tensor {name!r}: a dtype (a string)")
        elif key in _TENSOR_KEYS:
            fields[key] = reader.integers(f"tensor {name!r}: {key}")
        else:
            reader.refuse(f"gives tensor {name!r} the key {key[:80]!r}, which safetensors does not know "
                          "(dtype, shape, data_offsets)")
    if len(fields) != len(_TENSOR_KEYS):
        reader.refuse(f"entry {name!r} is not a tensor: it lacks "
                      f"{', '.join(key for key in _TENSOR_KEYS if key not in fields)}")
    dtype, shape, offsets = (fields[key] for key in _TENSOR_KEYS)
    assert isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list)
    if len(offsets) != 2:
        reader.refuse(f"says tensor {name!r}: data_offsets {offsets}, which is not [begin, end]")
    return HeaderTensor(name, dtype, tuple(shape), offsets[0], offsets[1])


def parse_index(path: str, read: Callable[[int], bytes], length: int) -> tuple[dict[str, str], dict[str, Scalar]]:
    """The ``weight_map`` (tensor -> shard file, at most ``MAX_TENSORS``) and ``metadata`` of the
    ``length``-byte index ``path`` that ``read(n)`` gives."""
    reader = _Reader(path, "index", read, length)
    weight_map: dict[str, str] | None = None
    metadata: dict[str, Scalar] = {}
    shape = "'{' (an index is a JSON object whose 'weight_map' maps tensor names to shard files)"
    for key in reader.members(shape):
        if key == "weight_map":
            weight_map = {}
            for name in reader.members(shape):
                if len(weight_map) == MAX_TENSORS:
                    reader.refuse(f"lists more than {MAX_TENSORS} tensors (one layout's most)")
                weight_map[name] = reader.string(f"a string (the file of tensor {name[:80]!r})")
        elif key == "metadata":
            if not reader.literal(_NULL):
                metadata = {name: reader.scalar() for name in reader.members("'{' or null (the index's metadata)")}
        else:
            reader.refuse(f"has the key {key[:80]!r}: an index holds 'weight_map' and 'metadata'")
    reader.end()
    if weight_map is None:
        reader.refuse("has no 'weight_map' (it maps tensor names to shard files)")
    return weight_map, metadata


__all__ = ["HeaderTensor", "Scalar", "parse_header", "parse_index"]
