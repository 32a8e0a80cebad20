"""The start-up checks of agentic serving's flags (tool calling and reasoning, in vLLM's
spelling), which `ServerConfig` declares (hotswap/entrypoints/server/state.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hotswap.entrypoints.server.state import ServerConfig


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
