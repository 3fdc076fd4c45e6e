"""Reading a model directory's JSON files with errors that say which file and which field is
wrong: typed field reads (the JSON types the Hugging Face format writes; null counts as absent
only where HF writes null) and a context that prefixes every error with the file's path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def read_json(path: Path, *, fix: str) -> Any:
    """The JSON in `path`; ValueError naming the file, what is wrong and `fix` (what to do)
    when it is not UTF-8 or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error.reason}); {fix}") from error
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno} column "
            f"{error.colno}); {fix}"
        ) from error


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """Prefix every ValueError raised inside with `path`, so it says which file is wrong."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


_ABSENT = object()


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "integer": (is_int, "an integer"),
    "number": (is_number, "a finite number"),
    "boolean": (lambda v: isinstance(v, bool), "a boolean (true or false)"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
}

_JSON_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def describe(value: Any) -> str:
    """`value` as config.json spells it, with its JSON type: `"30" (a string)`."""
    if value is None:
        return "null"
    text = json.dumps(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({_JSON_TYPE_NAMES.get(type(value), type(value).__name__)})"


def typed_field(
    raw: dict[str, Any],
    name: str,
    kind: str,
    default: Any = _ABSENT,
    *,
    nullable: bool = False,
    where: str = "",
) -> Any:
    """raw[name], which must be JSON of `kind` (or null, read as absent, where `nullable`);
    `default` when absent. Numbers come back as floats. `where` prefixes nested names."""
    value = raw.get(name)
    if name not in raw or (value is None and nullable):
        if default is _ABSENT:
            raise ValueError(f'missing required field "{where}{name}"')
        return default
    check, expected = _KINDS[kind]
    if not check(value):
        expected += " or null" if nullable else ""
        raise ValueError(f'field "{where}{name}" must be {expected}, got {describe(value)}')
    return float(value) if kind == "number" else value


def require_object(raw: Any) -> None:
    if not isinstance(raw, dict):
        raise ValueError(f"the config must be a JSON object of fields, got {describe(raw)}")


def strings(raw: dict[str, Any], name: str) -> list[str] | None:
    values = typed_field(raw, name, "array", None, nullable=True)
    if values is not None and not all(isinstance(v, str) for v in values):
        raise ValueError(f'field "{name}" must be an array of strings, got {describe(values)}')
    return values


def integers(raw: dict[str, Any], name: str, *, where: str = "") -> list[int] | None:
    values = typed_field(raw, name, "array", None, nullable=True, where=where)
    if values is not None and not all(is_int(v) for v in values):
        raise ValueError(
            f'field "{where}{name}" must be an array of integers, got {describe(values)}'
        )
    return values


def token_ids(raw: dict[str, Any], name: str) -> tuple[int, ...]:
    """A token-id field HF writes as an integer, an array of integers, or null."""
    value = raw.get(name)
    if value is None:
        return ()
    if is_int(value):
        return (value,)
    if isinstance(value, list) and all(is_int(v) for v in value):
        return tuple(value)
    raise ValueError(
        f'field "{name}" must be an integer, an array of integers or null, got {describe(value)}'
    )
