"""Reading msgspec's validation errors: the path inside a value at which a field was
refused, and types in words. The verb table (engine/verbs.py) and the transfer infos
(weight_transfer/infos.py) both name a refused field by its path (`tensors[3].data`,
`update_info.shapes[2]`) from these, so the two never disagree on how."""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from hotswap.errors import InvalidArgument

# msgspec's "<what> - at `$<path>`", the path a run of `[index]` and `.field` segments.
_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
SEGMENT = re.compile(r"\[[0-9]+\]|\.\w+")
MISSING = re.compile(r"^Object missing required field `(\w+)`$")
UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$", re.DOTALL)

WORDS = {bool: "a boolean", int: "an integer", str: "a string", float: "a number"}


def split_error(error: str) -> tuple[str, str] | None:
    """(what was wrong, the path it was wrong at: "" for the value itself), or None when
    msgspec named no path."""
    at = _AT.match(error)
    return None if at is None else (at.group("what"), at.group("path"))


def unwrapped(field_type: Any) -> Any:
    """`field_type` without Annotated metadata or an optional None."""
    while True:
        origin, parts = typing.get_origin(field_type), typing.get_args(field_type)
        if origin is Annotated:
            field_type = parts[0]
        elif origin in (typing.Union, types.UnionType) and type(None) in parts:
            rest = [p for p in parts if p is not type(None)]
            if len(rest) != 1:
                return field_type
            field_type = rest[0]
        else:
            return field_type


def shown(value: object) -> str:
    """A value as a refusal quotes it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def type_at(field_type: Any, segments: list[str]) -> Any:
    """The declared type at a path of list indexes and struct fields inside `field_type`."""
    for segment in segments:
        field_type = unwrapped(field_type)
        if segment.startswith("["):
            field_type = typing.get_args(field_type)[0]
        else:
            fields = {f.name: f.type for f in msgspec.structs.fields(field_type)}
            field_type = fields[segment[1:]]
    return field_type


def describe(field_type: Any) -> str:
    """What a field accepts, in words, from its declared type."""
    origin, parts = typing.get_origin(field_type), typing.get_args(field_type)
    if origin is Annotated:
        meta = [m for m in parts[1:] if isinstance(m, msgspec.Meta) and m.description]
        return meta[0].description if meta else describe(parts[0])
    if origin is Literal:
        return "one of " + ", ".join(str(p) for p in parts)
    if origin in (typing.Union, types.UnionType):
        named = [describe(p) for p in parts if p is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in parts else "")
    if origin is list:
        return f"a list of {describe(parts[0]) if parts else 'values'}"
    return WORDS.get(field_type, getattr(field_type, "__name__", str(field_type)))


def nested_refusal(name: str, field_type: Any, error: str) -> InvalidArgument | None:
    """The refusal of a field inside a struct the argument holds, named by its path
    (`tensors[3].data`, from msgspec's `... - at `$[3].data``); None when the argument or
    a plain list's element is at fault (`tags` stays `tags`)."""
    at = split_error(error)
    if at is None:
        return None
    what, path = at
    segments = SEGMENT.findall(path)
    if "".join(segments) != path:  # a dict's key: not a path of fields
        return None
    missing, unknown = MISSING.match(what), UNKNOWN.match(what)
    if missing is not None:
        field = f"{name}{path}.{missing.group(1)}"
        return InvalidArgument(field, f"{field}: required")
    if unknown is not None:
        key = unknown.group(1)
        field = f"{name}{path}" + (f".{key}" if re.fullmatch(r"\w{1,64}", key) else "")
        return InvalidArgument(field, f"{field}: no such field ({shown(key)} is unknown)")
    last = max((i for i, s in enumerate(segments) if s.startswith(".")), default=None)
    if last is None:
        return None
    field = name + "".join(segments[: last + 1])
    where = "".join(segments[last + 1 :])
    expected = describe(type_at(field_type, segments[: last + 1]))
    return InvalidArgument(
        field, f"{field}: must be {expected} ({what}{f' at {field}{where}' if where else ''})"
    )
