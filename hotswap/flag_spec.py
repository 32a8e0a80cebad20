"""How a declared field becomes a command-line flag: its `Flag` metadata (help, choices,
aliases, vLLM's spelling), attached by `arg`. hotswap/entrypoints/flags.py derives the
parsers from the fields of `EngineArgs`, `ServerConfig` and the other declarations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line: `--field-name` (underscores become
    dashes), typed from the field's annotation, defaulting to the field's default. A field
    holding a parsed form of its flag's text declares the text's annotation (`cli_type`):
    the flag then defaults to None, absent, and `parse` maps its value, None included, to
    the field's (hotswap/entrypoints/flags.py derives the parser and the values)."""

    help: str | None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # further spellings, e.g. vLLM's or an older one
    name: str | None = None  # the flag's name where it is not the field's (vLLM's spelling)
    cli_type: Any = None  # the flag's value's annotation where the field holds a parsed form
    parse: Callable[[Any], Any] | None = None  # the flag's value -> the field's (default: as is)
    # argparse's action where the type's is not the flag's: "store_true" (a switch with no
    # --no-x, as the flag always was), "extend" (a list over several uses of the flag)
    action: str | None = None


FLAG_KEY = "flag"  # the field metadata key holding its Flag; a field without one has no flag


def arg(default: Any = MISSING, help: str | None = None, **flag: Any) -> Any:
    """A field that is also a CLI flag (see `Flag` for the keyword arguments); MISSING: a
    field with no default."""
    return field(default=default, metadata={FLAG_KEY: Flag(help, **flag)})
