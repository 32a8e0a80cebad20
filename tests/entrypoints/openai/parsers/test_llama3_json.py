"""`llama3_json`: `<|python_tag|>{"name": ..., "parameters": {...}}; {...}`."""

from __future__ import annotations

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, Llama3JsonToolParser
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools, streamed_so_far


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


def test_the_first_of_arguments_and_parameters_counts() -> None:
    """It streams as soon as it opens (vLLM's non-streamed path prefers "arguments")."""
    text = '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'
    assert calls_of(check_tools(Llama3JsonToolParser, text)) == [("f", {"a": 1})]
    text = '{"name": "f", "parameters": {"b": 2}, "arguments": {"a": 1}}'
    assert calls_of(check_tools(Llama3JsonToolParser, text)) == [("f", {"b": 2})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        'Sure: {"name": "f", "parameters": {}}',  # prose first: not calls (as vLLM streams)
        '{"answer": 42}',  # JSON, not a call
        '{"name": "f", "parameters": ',  # cut off before the arguments opened
        '{"parameters": {"a": 1}, "name": "f',  # before the name closed
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


def test_each_call_streams_as_it_is_generated() -> None:
    parser = Llama3JsonToolParser(None)
    assert parser.feed("  <|python").content is None
    delta = parser.feed('_tag|>{"name": "f", "parameters": {"a": ')
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, "f", "{")
    ]
    delta = parser.feed('"}"}}; {"name": "g"')
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, None, '"a": "}"}')
    ]
    delta = parser.feed(', "parameters": {')
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (1, "g", "{")
    ]
    assert parser.feed("}}").tool_calls[0].function.arguments == "}"
    assert parser.finish().content is None


def test_numbers_and_literals_are_sent_once_they_end() -> None:
    text = '{"name": "f", "parameters": {"n": -12.50e1, "b": false, "z": null}}'
    seen = streamed_so_far(Llama3JsonToolParser, text)
    assert seen[text.index("e1") + 2] == [("f", "{")]
    assert seen[text.index("e1,") + 3] == [("f", '{"n": -125.0')]
    assert seen[text.index("fals") + 4] == [("f", '{"n": -125.0')]
    assert seen[text.index("false") + 5] == [("f", '{"n": -125.0, "b": false')]
    result = check_tools(Llama3JsonToolParser, text)
    assert result.tool_calls[0].function.arguments == '{"n": -125.0, "b": false, "z": null}'


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "f", "parameters": {"a": 1}', [("f", '{"a": 1}')]),  # cut off
        ('{"name": "f", "parameters": {"a": "x', [("f", '{"a": "x"}')]),
        (
            '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"a": [1, tru',
            [("f", "{}"), ("g", '{"a": [1]}')],
        ),
        ('{"name": "f", "parameters": {"a": 01}}; {"name": "g"}', [("f", "{}")]),  # bad number
    ],
)
def test_malformed_after_the_start_stays_as_sent_closed(
    text: str, calls: list[tuple[str, str]]
) -> None:
    result = check_tools(Llama3JsonToolParser, text)
    assert result.content is None
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == calls


def test_registered_under_vllm_names() -> None:
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["llama4_json"] is Llama3JsonToolParser
