"""Fields a dialect declares only so that a body sending them is understood, and accepts
at their default value alone: hotswap does not implement them, and a field the dialect
knows is never silently ignored (an unknown one is, as vLLM ignores it).

Every dialect declares such fields as a `DefaultOnly` table and refuses them with
`check_default_only`, a 400 naming the field. What differs between dialects is data, not
code: which values count as the default (`accepts`) and the words of the refusal
(`message`), which stay each dialect's own because clients and tests read them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hotswap.entrypoints.server.errors import bad_request


@dataclass(frozen=True)
class Only:
    """What one field is accepted at: `values` (its default and what means the same), and
    `why`, what hotswap would have to implement to honour any other value."""

    values: tuple[Any, ...] = (None,)
    why: str = ""


def same(value: Any, only: Only) -> bool:
    """One of the values, of the same kind: `true` is not `1`, nor `false` `0`."""
    return any(
        isinstance(value, bool) == isinstance(ok, bool) and value == ok for ok in only.values
    )


def equal(value: Any, only: Only) -> bool:
    """One of the values by `==` (a raw JSON value: `1` is `true`)."""
    return any(value == ok for ok in only.values)


def absent(value: Any, only: Only | None = None) -> bool:
    """SGLang's: null, false, or a container of such ([None, None]: a batch without
    images), whatever the values declared."""
    if value is None or value is False:
        return True
    if isinstance(value, (list, dict)):
        items = value.values() if isinstance(value, dict) else value
        return all(absent(item) for item in items)
    return False


@dataclass(frozen=True)
class DefaultOnly:
    """One dialect's table: field -> what it is accepted at.

    `message` is the refusal, a `str.format` template that may use `{name}` (the field),
    `{field}` (the field as messages name it, under its parent: `sampling_params.x`),
    `{value!r}`, `{short}` (the value's repr, cut at 60 characters), `{allowed}` (the
    values accepted, as reprs) and `{why}`."""

    fields: Mapping[str, Only]
    message: str
    accepts: Callable[[Any, Only], bool] = same


def check_default_only(
    table: DefaultOnly, values: Mapping[str, Any] | object, param: str = "body"
) -> None:
    """400 `{param}.<field>` for the first field of `table` whose value it does not accept.
    `values`: a request model, read in the table's order (a field the model does not
    declare is absent: chat has no `suffix`), or a mapping of raw values, read in its own
    order (the body's, so that the first field refused is the first one sent)."""
    if isinstance(values, Mapping):
        given = [(name, value) for name, value in values.items() if name in table.fields]
    else:
        given = [(name, getattr(values, name, None)) for name in table.fields]
    for name, value in given:
        only = table.fields[name]
        if table.accepts(value, only):
            continue
        parent = param.removeprefix("body").lstrip(".")
        message = table.message.format(
            name=name,
            field=f"{parent}.{name}".lstrip("."),
            value=value,
            short=short_repr(value),
            allowed=", ".join(repr(ok) for ok in only.values),
            why=only.why,
        )
        raise bad_request(message, f"{param}.{name}")


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a refusal quotes what was sent, not a
    megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
