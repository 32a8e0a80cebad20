"""The engine's command-line flags, derived from `EngineArgs` (hotswap/engine_args.py) by
hotswap/entrypoints/flags.py: one flag per field that declares a `Flag`."""

from __future__ import annotations

import argparse
from typing import Any

from hotswap.engine_args import EngineArgs
from hotswap.entrypoints.flags import add_flags, flag_names, flag_values

__all__ = ["add_engine_args", "engine_kwargs", "flag_names"]


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Every `EngineArgs` flag, in the "engine" group of `parser`."""
    group = parser.add_argument_group("engine")
    add_flags(group, EngineArgs)
    return group


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineArgs` keyword arguments a parsed command line gives (all but `model`,
    which `serve` also takes as a positional argument)."""
    return {k: v for k, v in flag_values(EngineArgs, args).items() if k != "model"}
