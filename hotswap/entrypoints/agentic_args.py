"""The command-line flags of agentic serving, in vLLM's spelling: tool calling, reasoning,
and structured-output defaults (`hotswap serve`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hotswap.entrypoints.server.state import ServerConfig


def add_agentic_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's tool-calling and reasoning flags (parsers by vLLM's names)."""
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose to call tools (tool_choice "auto"; needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are read from the model's text: hermes (Qwen2.5/Qwen3), "
        "qwen3_coder, llama3_json, pythonic",
    )
    group.add_argument(
        "--structured-outputs-config",
        default=None,
        metavar="JSON",
        help="defaults for every constraint, e.g. '{\"disable_any_whitespace\": true}' "
        "(vLLM's flag, compiled by llguidance). backend: auto (vLLM's default: a JSON "
        "schema allows only the properties it lists) or guidance (JSON Schema's open "
        "objects, unless disable_additional_properties)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split the model's thinking into `reasoning`: qwen3, deepseek_r1",
    )


def check_parsers(config: ServerConfig) -> None:
    """vLLM's start-up checks: known parser names; auto tool choice needs a parser."""
    from hotswap.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS

    for flag, name, known in (
        ("--tool-call-parser", config.tool_call_parser, TOOL_PARSERS),
        ("--reasoning-parser", config.reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"{flag}: unknown parser {name!r} (known: {', '.join(sorted(known))})")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice: requires --tool-call-parser")
