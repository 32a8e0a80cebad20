"""The engine's command-line flags, derived from `EngineArgs` (hotswap/engine_args.py):
one flag per field that declares a `Flag`, named `--field-name`, typed by the field's
annotation, defaulting to the field's default, with the field's help, choices and
aliases. A field is declared once; nothing here names one."""

from __future__ import annotations

import argparse
import functools
import types
import typing
from dataclasses import Field, fields
from typing import Any

from hotswap.engine_args import FLAG_KEY, EngineArgs, Flag


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Every `EngineArgs` flag, in the "engine" group of `parser`."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = f.metadata.get(FLAG_KEY)
        if flag is not None:
            group.add_argument(*flag_names(f.name, flag), **_argument(f, flag))
    return group


def flag_names(name: str, flag: Flag) -> tuple[str, ...]:
    return ("--" + name.replace("_", "-"), *flag.aliases)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineArgs` keyword arguments a parsed command line gives (all but `model`,
    which `serve` also takes as a positional argument)."""
    names = EngineArgs.field_names() - {"model"}
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _argument(f: Field, flag: Flag) -> dict[str, Any]:
    """add_argument's keywords for field `f`: bools take vLLM's --x / --no-x, lists one
    or more values, every other value one string converted to the field's scalar type."""
    kind = _scalar(_field_types()[f.name])
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": flag.help}
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
    return kwargs


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(EngineArgs)


def _scalar(annotation: Any) -> type:
    """The type a flag's text converts to: the annotation without None; `str` where it
    also admits a Python-only form (a dict given as JSON text on the command line)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [p for p in typing.get_args(annotation) if p is not type(None)]
        return _scalar(parts[0]) if len(parts) == 1 else str
    if origin is list:
        return list
    if annotation in (bool, int, float, str):
        return annotation
    raise TypeError(f"EngineArgs: no command-line form for {annotation!r}")
