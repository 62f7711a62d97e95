"""protos/PROTOCOL.md against protos: the doc must say what the code says.

What is checked, so that whoever adds an op, an argument, an error code, a
record field or a limit, or bumps the version, has to write it down:

* a line ``Protocol version: N`` with N == ``PROTOCOL_VERSION``, and a
  ``### Version N`` entry under "Changes by version";
* under the ``## 10. Ops`` section, one ``### `name``` heading per op in
  ``cuctxd.protos.schema.OPS`` (no more, no fewer, in registration order);
* in each op's section, a ``**Arguments**`` table whose first column lists
  exactly that op's fields as `` `name` ``, with "required" in the third column
  exactly for fields without a default and a non-None default written in it;
  an op without fields says ``**Arguments**: none.``;
* a table row ``| `NAME` | code |`` for every ``ErrorCode`` and ``CUresult``;
* a field table for every record in ``cuctxd.protos.records``;
* a table row ``| `NAME` | value |`` for every constant in ``cuctxd.protos.limits``;
* under ``### Daemon limits``, one row per limit setting of ``DaemonConfig`` (declared ``limit=True``),
  with its flag and default as the declaration makes them.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from cuctxd import protos
from cuctxd.protos import limits, records
from cuctxd.protos.cuda_results import CUresult
from cuctxd.protos.errors import ErrorCode
from cuctxd.protos.schema import OPS, OpSpec
from cuctxd.protos.version import PROTOCOL_VERSION

DOC_PATH = Path(protos.__file__).resolve().parent / "PROTOCOL.md"
OPS_SECTION = "## 10. Ops"


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC_PATH.is_file(), f"{DOC_PATH} is missing"
    return DOC_PATH.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        raise AssertionError(f"PROTOCOL.md has no heading {heading!r}") from None
    body = []
    for line in lines[start + 1:]:
        match = re.match(r"^(#+) ", line)
        if match and len(match.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body)


def _op_sections(doc: str) -> dict[str, str]:
    """Op name -> its section text, in document order."""
    ops_text = _section(doc, OPS_SECTION)
    sections: dict[str, str] = {}
    current: str | None = None
    for line in ops_text.splitlines():
        match = re.match(r"^### `([a-z_][a-z0-9_]*)`\s*$", line)
        if match:
            current = match.group(1)
            assert current not in sections, f"op {current!r} has two headings in PROTOCOL.md"
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def _table_rows(lines: list[str]) -> list[list[str]]:
    """Rows (cells stripped; header row and rule left out) of the first table in ``lines``."""
    rows: list[list[str]] = []
    for line in lines:
        if not line.strip():
            if rows:
                break
            continue
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert len(rows) >= 2, "no table found"
    return rows[2:]


def _table_after(text: str, marker: str) -> list[list[str]] | None:
    """The rows of the table right after the ``marker`` line; None when that line says "none"."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    except StopIteration:
        raise AssertionError(f"no {marker!r} line") from None
    if "none" in lines[start][len(marker):].lower():
        return None
    following = lines[start + 1:]
    first_text = next((line for line in following if line.strip()), "")
    assert first_text.startswith("|"), f"{marker!r} must be followed by a table or say 'none'"
    return _table_rows(following)


def _first_column_names(rows: list[list[str]]) -> list[str]:
    names = []
    for row in rows:
        match = re.fullmatch(r"`([^`]+)`", row[0])
        assert match, f"first cell {row[0]!r} is not a `name`"
        names.append(match.group(1))
    return names


def _wire_type(hint: object) -> str:
    """The doc's name for an argument's type; ``int | None`` is an optional int."""
    members = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    assert len(members) == 1, f"unexpected argument type {hint!r}"
    return {int: "int", str: "str", bool: "bool", bytes: "bin"}[members[0]]


def _row_for(doc: str, name: str) -> list[str] | None:
    for line in doc.splitlines():
        if line.startswith(f"| `{name}` |"):
            return [cell.strip() for cell in line.strip().strip("|").split("|")]
    return None


# --- version ------------------------------------------------------------------------


def test_states_the_protocol_version(doc: str) -> None:
    stated = re.findall(r"^Protocol version: (\d+)\s*$", doc, flags=re.MULTILINE)
    assert stated, "PROTOCOL.md needs a line 'Protocol version: N'"
    assert [int(v) for v in stated] == [PROTOCOL_VERSION], (
        f"PROTOCOL.md states protocol version {stated}, protos/version.py says {PROTOCOL_VERSION}"
    )


def test_changes_by_version_covers_the_current_version(doc: str) -> None:
    changes = _section(doc, "## 16. Changes by version")
    assert re.search(rf"^### Version {PROTOCOL_VERSION}\s*$", changes, flags=re.MULTILINE), (
        f"'Changes by version' has no '### Version {PROTOCOL_VERSION}' entry"
    )


# --- ops and their arguments ----------------------------------------------------------


def test_every_op_has_a_heading_in_registration_order(doc: str) -> None:
    documented = list(_op_sections(doc))
    missing = [name for name in OPS if name not in documented]
    stale = [name for name in documented if name not in OPS]
    assert not missing, f"ops without a '### `name`' heading under {OPS_SECTION!r}: {missing}"
    assert not stale, f"PROTOCOL.md documents ops that cuctxd.protos.schema.OPS lacks: {stale}"
    assert documented == list(OPS), "ops are documented in a different order than they are registered"


@pytest.mark.parametrize("name", list(OPS))
def test_op_arguments_are_documented(doc: str, name: str) -> None:
    sections = _op_sections(doc)
    if name not in sections:
        pytest.fail(f"op {name!r} has no section in PROTOCOL.md")
    spec: OpSpec = OPS[name]
    rows = _table_after(sections[name], "**Arguments**")
    fields = {f.name: f for f in dataclasses.fields(spec.args_type)}
    if rows is None:
        assert not fields, f"{name}: PROTOCOL.md says no arguments, the op has {sorted(fields)}"
        return
    documented = _first_column_names(rows)
    assert sorted(documented) == sorted(fields), (
        f"{name}: documented arguments {documented}, protos/ops.py has {list(fields)}"
    )
    hints = typing.get_type_hints(spec.args_type)
    for row in rows:
        field = fields[_first_column_names([row])[0]]
        assert len(row) >= 4, f"{name}.{field.name}: the row needs name, type, required/default, constraints"
        wire_type = _wire_type(hints[field.name])
        assert wire_type in row[1], f"{name}.{field.name}: type column {row[1]!r} should say {wire_type}"
        required = field.default is dataclasses.MISSING
        says_required = row[2].lower().startswith("required")
        assert says_required == required, (
            f"{name}.{field.name}: {'required' if required else 'optional'} in protos, "
            f"PROTOCOL.md says {row[2]!r}"
        )
        if not required and field.default is not None:
            literal = f"`{field.default!r}`".replace("'", '"')
            assert literal in row[2], f"{name}.{field.name}: default {literal} not stated in {row[2]!r}"


# --- codes, records, limits --------------------------------------------------------------


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_every_error_code_is_documented(doc: str, code: ErrorCode) -> None:
    row = _row_for(doc, code.name)
    assert row is not None, f"PROTOCOL.md has no table row for {code.name}"
    assert row[1] == str(int(code)), f"{code.name}: PROTOCOL.md says code {row[1]}, protos says {int(code)}"
    assert len(row) >= 3 and row[2], f"{code.name}: say when it occurs"


@pytest.mark.parametrize("result", list(CUresult), ids=lambda r: r.name)
def test_every_cuda_result_is_documented(doc: str, result: CUresult) -> None:
    row = _row_for(doc, result.name)
    assert row is not None, f"PROTOCOL.md has no table row for {result.name}"
    assert row[1] == str(int(result)), f"{result.name}: PROTOCOL.md says {row[1]}, protos says {int(result)}"


def _record_types() -> list[type]:
    return [
        cls for cls in vars(records).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == records.__name__
    ]


@pytest.mark.parametrize("record", _record_types(), ids=lambda cls: cls.__name__)
def test_every_record_field_is_documented(doc: str, record: type) -> None:
    headings = {
        "DeviceInfo": "### Device record",
        "ContextRecord": "### Context record",
        "BufferRecord": "### Buffer record",
    }
    # Any other record: its class name in words, e.g. ShareDescriptor -> "### Share descriptor".
    heading = headings.get(record.__name__) or "### " + re.sub(
        r"(?<!^)([A-Z])", r" \1", record.__name__
    ).capitalize()
    section = _section(_section(doc, "## 11. Records"), heading)
    documented = _first_column_names(_table_rows(section.splitlines()))
    expected = [f.name for f in dataclasses.fields(record)]
    assert sorted(documented) == sorted(expected), (
        f"{heading}: documented fields {documented}, protos/records.py has {expected}"
    )


_LIMITS = {name: value for name, value in vars(limits).items() if name.isupper() and isinstance(value, int)}


@pytest.mark.parametrize("name", list(_LIMITS))
def test_every_limit_is_documented(doc: str, name: str) -> None:
    row = _row_for(doc, name)
    assert row is not None, f"PROTOCOL.md has no table row for limits.{name}"
    assert row[1] == str(_LIMITS[name]), f"{name}: PROTOCOL.md says {row[1]}, protos/limits.py says {_LIMITS[name]}"


def test_the_daemon_limits_table_lists_every_limit_setting_once(doc: str) -> None:
    """Key, flag and default of each row are made from the settings' declarations (the parts' limits objects
    that DaemonConfig unites, :func:`cuctxd.daemon.settings.limit_rows`); what a limit bounds and what a
    client gets is the spec's. The rows keep the order they were added in (new limits at the end), which
    is not the declarations' (those are grouped by the part that reads them)."""
    from cuctxd.daemon.service.config import SETTINGS
    from cuctxd.daemon.settings import limit_rows

    expected = limit_rows(SETTINGS)
    rows = _table_rows(_section(doc, "### Daemon limits").splitlines())
    documented = [tuple(row[:3]) for row in rows]
    assert len(documented) == len(set(documented)), "PROTOCOL.md's daemon limits table lists a row twice"
    assert sorted(documented) == sorted(expected), "PROTOCOL.md's daemon limits table should start its rows with:\n" \
        + "\n".join(f"| {key} | {flag} | {default} |" for key, flag, default in expected)
    for row in rows:
        assert row[3] and row[4], f"{row[0]}: what it bounds and what happens when it is reached must be given"
