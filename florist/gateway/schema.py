"""Typed HTTP request models: frozen dataclasses checked against their own annotations.

    @dataclass(frozen=True)
    class RerankRequest:
        query: str
        texts: list[str]
        raw_scores: bool = False

    parse(RerankRequest, body)   # -> RerankRequest, or ApiError(400) naming the field and the fix

Scalars, `Literal`, `X | None` and `list[...]` are checked here; a field annotated `Any` (the
polymorphic `input` of the embedding routes) is left to the model's `__post_init__`, which
raises `ApiError` itself. Unknown fields are refused, so a misspelt option is not silently
ignored. JSON `true` is not an integer, and an integer is a number.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal

from florist.gateway.errors import bad_request

_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}


def json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def matches(value: Any, hint) -> bool:
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if _is_union(hint):
        return any(matches(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(matches(v, item) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe(hint) -> str:
    if hint is type(None):
        return "null"
    if _is_union(hint):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return "a list of " + _plural(describe(item))
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(desc: str) -> str:
    """"a string" -> "strings", "a list of integers" -> "lists of integers"."""
    desc = desc.removeprefix("a ").removeprefix("an ")
    return "lists of " + desc.removeprefix("list of ") if desc.startswith("list of ") else desc + "s"


@functools.cache
def _fields(cls) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _shown(value: Any) -> str:
    text = repr(value)
    return f" ({text[:40]}...)" if len(text) > 40 else f" ({text})"


def parse(cls, body: Any):
    """Build `cls` from a decoded JSON body, or raise ApiError(400) with an actionable message."""
    fields = _fields(cls)
    names = [f.name for f, _ in fields]
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object with the fields {', '.join(names)}; got {json_type(body)}")
    unknown = [k for k in body if k not in names]
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; this route takes: {', '.join(names)}", param=unknown[0])
    values = {}
    for f, hint in fields:
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise bad_request(f"missing field {f.name!r}: it must be {describe(hint)}", param=f.name)
            continue
        value = body[f.name]
        if not matches(value, hint):
            expected = f.metadata.get("expects") or describe(hint)
            shown = _shown(value) if isinstance(value, (str, int, float)) else ""
            raise bad_request(f"{f.name} must be {expected}; got {json_type(value)}{shown}", param=f.name)
        values[f.name] = value
    return cls(**values)
