"""Command-line flags derived from a frozen dataclass whose fields declare a `Flag`
(hotswap/engine_args.py): `EngineArgs` for the engine's, `ServerConfig` for the server's.
One flag per such field, named `--field-name` (or the Flag's `name`), typed by the field's
annotation (or the Flag's `cli_type`), defaulting to the field's default (None where the
flag has its own type), with the field's help, choices, metavar and aliases. A field is
declared once; nothing here names one."""

from __future__ import annotations

import argparse
import functools
import types
import typing
from dataclasses import Field, fields
from typing import Any

from hotswap.flag_spec import FLAG_KEY, Flag

# What add_argument is given: a parser or one of its groups.
Adder = argparse.ArgumentParser | argparse._ArgumentGroup


def add_flags(adder: Adder, cls: type) -> None:
    """Every flag `cls` declares, in field order (the order of --help)."""
    for f, flag in flagged_fields(cls):
        adder.add_argument(*flag_names(f.name, flag), **_argument(cls, f, flag))


def flagged_fields(cls: type) -> list[tuple[Field, Flag]]:
    """`cls`'s fields that are flags, with their Flag; a field without one has no flag."""
    return [(f, f.metadata[FLAG_KEY]) for f in fields(cls) if FLAG_KEY in f.metadata]


def flag_names(name: str, flag: Flag) -> tuple[str, ...]:
    """The spellings of field `name`'s flag: its own, then its aliases."""
    return ("--" + flag_dest(name, flag).replace("_", "-"), *flag.aliases)


def flag_dest(name: str, flag: Flag) -> str:
    """Where a parsed command line holds field `name`'s flag."""
    return flag.name or name


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The field values a parsed command line gives `cls`: each flag's value, parsed where
    its field declares how (in field order, so a refusal is the first bad flag's)."""
    values = {}
    for f, flag in flagged_fields(cls):
        value = getattr(args, flag_dest(f.name, flag))
        values[f.name] = value if flag.parse is None else flag.parse(value)
    return values


def flag_default(f: Field, flag: Flag) -> Any:
    """A flag's default: its field's, or None (absent) where the flag has its own type."""
    return None if flag.cli_type is not None else f.default


def _argument(cls: type, f: Field, flag: Flag) -> dict[str, Any]:
    """add_argument's keywords for field `f`: bools take vLLM's --x / --no-x, lists one
    or more values, every other value one string converted to the field's scalar type;
    a declared action replaces the type's."""
    annotation = flag.cli_type if flag.cli_type is not None else _field_types(cls)[f.name]
    kind = _scalar(annotation, f"{cls.__name__}.{f.name}")
    dest = flag_dest(f.name, flag)
    kwargs: dict[str, Any] = {"dest": dest, "default": flag_default(f, flag), "help": flag.help}
    if flag.choices is not None:
        kwargs["choices"] = list(flag.choices)
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind is list:
        kwargs["nargs"] = "+"
    elif kind in (int, float):
        kwargs["type"] = kind
    if flag.action is not None:
        kwargs["action"] = flag.action
    return kwargs


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(annotation: Any, where: str) -> type:
    """The type a flag's text converts to: the annotation without None; `str` where it
    also admits a Python-only form (a dict given as JSON text on the command line)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [p for p in typing.get_args(annotation) if p is not type(None)]
        return _scalar(parts[0], where) if len(parts) == 1 else str
    if origin is list:
        return list
    if annotation in (bool, int, float, str):
        return annotation
    raise TypeError(f"{where}: no command-line form for {annotation!r}")
