"""The registries the chat route looks parsers up in, and tool call ids."""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReasoningParser,
    ToolParser,
    make_tool_call_id,
)
from tests.entrypoints.openai.parsers.helpers import TOOL_CALL_ID


def test_vllm_parser_names() -> None:
    assert {"hermes", "qwen3_coder", "llama3_json", "pythonic"} <= set(TOOL_PARSERS)
    assert all(issubclass(cls, ToolParser) for cls in TOOL_PARSERS.values())
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert all(issubclass(cls, ReasoningParser) for cls in REASONING_PARSERS.values())


def test_tool_call_ids_are_vllm_shaped_and_unique() -> None:
    ids = {make_tool_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(TOOL_CALL_ID.fullmatch(i) for i in ids)
