"""Streaming harness for the parser tests: every text is fed whole, split in two at every
character boundary, and one character at a time, and each run must emit exactly what the
parser's `extract` returns for the whole text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from hotswap.entrypoints.openai.parsers import (
    ExtractedToolCalls,
    ReasoningParser,
    ToolParser,
)

TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def splits(text: str) -> Iterator[list[str]]:
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def stream_tools(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) a streamed run emits; asserts vLLM's delta shapes: a
    call's first delta has its index (in order), id, type and name, later ones only
    argument fragments."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert delta.reasoning is None
        assert delta.content != ""  # nothing to say is None
        content.append(delta.content or "")
        for call in delta.tool_calls:
            assert call.function is not None
            if call.index not in calls:
                assert call.index == len(calls)
                assert TOOL_CALL_ID.fullmatch(call.id or ""), call.id
                assert call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.type is None and call.function.name is None
                assert call.function.arguments  # a later delta is a non-empty fragment
                calls[call.index][1] += call.function.arguments
    return "".join(content), [(name, arguments) for name, arguments in calls.values()]


def streamed_so_far(
    cls: type[ToolParser], text: str, tools: list[dict] | None = None
) -> list[list[tuple[str, str]]]:
    """Fed one character at a time (no finish): after each prefix `text[:i]` (index i), the
    calls [(name, arguments sent so far)] streamed until then."""
    parser = cls(tools)
    calls: list[tuple[str, str]] = []
    seen = [list(calls)]
    for ch in text:
        for call in parser.feed(ch).tool_calls:
            assert call.function is not None
            if call.index == len(calls):
                calls.append((call.function.name or "", ""))
            name, arguments = calls[call.index]
            calls[call.index] = (name, arguments + (call.function.arguments or ""))
        seen.append(list(calls))
    return seen


def check_tools(
    cls: type[ToolParser], text: str, tools: list[dict] | None = None
) -> ExtractedToolCalls:
    """`extract(text)`, after checking that every streamed run of `text` agrees with it:
    the same content (None streams as nothing) and the same names and arguments."""
    whole = cls(tools).extract(text)
    assert whole.tools_called == bool(whole.tool_calls)
    assert len({call.id for call in whole.tool_calls}) == len(whole.tool_calls)
    for call in whole.tool_calls:
        assert TOOL_CALL_ID.fullmatch(call.id) and call.type == "function"
        assert isinstance(json.loads(call.function.arguments), dict)
    expected = (
        whole.content or "",
        [(c.function.name, c.function.arguments) for c in whole.tool_calls],
    )
    for pieces in splits(text):
        assert stream_tools(cls(tools), pieces) == expected, pieces
    return whole


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, Any]]:
    """[(name, arguments as a dict)]"""
    return [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning: list[str] = []
    content: list[str] = []
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert delta.reasoning != "" and delta.content != "" and not delta.tool_calls
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


def check_reasoning(
    cls: type[ReasoningParser], text: str, **kwargs: bool
) -> tuple[str | None, str | None]:
    """`extract(text)`, after checking that every streamed run of `text` agrees with it."""
    reasoning, content = cls(**kwargs).extract(text)
    assert reasoning != "" and content != ""
    for pieces in splits(text):
        assert stream_reasoning(cls(**kwargs), pieces) == (reasoning or "", content or ""), pieces
    return reasoning, content
