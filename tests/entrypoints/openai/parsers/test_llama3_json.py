"""`llama3_json`: `<|python_tag|>{"name": ..., "parameters": {...}}; {...}`."""

from __future__ import annotations

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, Llama3JsonToolParser
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools


def test_python_tag_and_calls_separated_by_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF", "n": 2}}; '
        '{"name": "get_time", "arguments": {"tz": "PST"}}'
    )
    result = check_tools(Llama3JsonToolParser, text)
    assert result.tools_called and result.content is None
    assert calls_of(result) == [
        ("get_weather", {"city": "SF", "n": 2}),
        ("get_time", {"tz": "PST"}),
    ]


def test_bare_json_and_newline_separated_objects() -> None:
    text = (
        '\n{"name": "a", "parameters": {"s": "}{\\"", "l": [{"x": null}]}}\n'
        '{"name": "b", "parameters": {}};\n'
    )
    result = check_tools(Llama3JsonToolParser, text)
    assert result.content is None
    assert calls_of(result) == [("a", {"s": '}{"', "l": [{"x": None}]}), ("b", {})]


def test_arguments_preferred_over_parameters() -> None:
    text = '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'
    assert calls_of(check_tools(Llama3JsonToolParser, text)) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        'Sure: {"name": "f", "parameters": {}}',  # prose first: not calls (as vLLM streams)
        '{"answer": 42}',  # JSON, not a call
        '{"name": "f", "parameters": {"a": 1}',  # cut off
        '<|python_tag|>; {"name": "f", "parameters": {}}',
        '{"name": "f", "parameters": "not json"}',
        "<|python_tag|>",
        "<|python_ta",
        "{",
        "",
    ],
)
def test_not_calls_is_verbatim_content(text: str) -> None:
    result = check_tools(Llama3JsonToolParser, text)
    assert not result.tools_called
    assert result.content == (text or None)


@pytest.mark.parametrize(
    "rest", ['; {"oops": 1} and more', ';;{"name": "g", "parameters": {}}', "</s>", "; {"]
)
def test_failure_after_a_call_drops_the_rest(rest: str) -> None:
    result = check_tools(Llama3JsonToolParser, '{"name": "f", "parameters": {}}' + rest)
    assert result.content is None and calls_of(result) == [("f", {})]


def test_each_call_is_emitted_when_its_object_closes() -> None:
    parser = Llama3JsonToolParser(None)
    assert parser.feed("  <|python").content is None
    assert parser.feed('_tag|>{"name": "f", "parameters": {"a": ').tool_calls == []
    delta = parser.feed('"}"}}; {"name": "g"')
    assert [(c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        ("f", '{"a": "}"}')
    ]
    assert parser.feed(', "parameters": {}}').tool_calls[0].index == 1
    assert parser.finish().content is None


def test_registered_under_vllm_names() -> None:
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["llama4_json"] is Llama3JsonToolParser
