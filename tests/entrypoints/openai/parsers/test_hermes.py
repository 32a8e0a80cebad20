"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3)."""

from __future__ import annotations

import json

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, HermesToolParser
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools

QWEN_TWO_CALLS = (
    "Let me check both.\n\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def test_text_then_several_calls() -> None:
    result = check_tools(HermesToolParser, QWEN_TWO_CALLS)
    assert result.tools_called
    assert result.content == "Let me check both."  # the whitespace before the call dropped
    assert calls_of(result) == [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("get_time", {}),
    ]
    # vLLM's serialization: json.dumps(arguments, ensure_ascii=False)
    assert result.tool_calls[0].function.arguments == '{"city": "San Francisco", "days": 3}'


def test_arguments_reserialized_unicode_escapes_and_nesting() -> None:
    text = (
        '<tool_call>{"name":"search","arguments":{"q":"h\\u00e9llo \\"w\\"\\n}{",'
        '"opts":{"k":[1,2.5,true,null]}}}</tool_call>'
    )
    result = check_tools(HermesToolParser, text)
    assert result.content is None
    args = {"q": 'héllo "w"\n}{', "opts": {"k": [1, 2.5, True, None]}}
    assert calls_of(result) == [("search", args)]
    assert result.tool_calls[0].function.arguments == json.dumps(args, ensure_ascii=False)


def test_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert calls_of(check_tools(HermesToolParser, text)) == [("f", {"a": 1})]


def test_plain_text_is_verbatim_content() -> None:
    for text in ("Hello world.\n\n", "  a < b and <tool_cal> is not a tag <", "\n"):
        result = check_tools(HermesToolParser, text)
        assert not result.tools_called and result.tool_calls == []
        assert result.content == text
    assert HermesToolParser(None).extract("").content is None


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f", {}]</tool_call>',  # not an object
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',  # no JSON for nan
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off at the end
        "<tool_call>",  # only the tag
        "<tool_call>\n</tool_call>",
    ],
)
def test_malformed_call_is_content(call: str) -> None:
    text = "Calling.\n" + call + "\n"
    result = check_tools(HermesToolParser, text)
    assert not result.tools_called
    assert result.content == text


def test_call_left_open_at_the_end_counts_when_complete() -> None:
    text = 'Ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    result = check_tools(HermesToolParser, text)
    assert result.content == "Ok" and calls_of(result) == [("f", {"a": 1})]


def test_malformed_call_before_a_valid_one_stays_content() -> None:
    text = (
        '<tool_call>oops</tool_call>\n<tool_call>{"name": "f", "arguments": {"x": "y"}}</tool_call>'
    )
    result = check_tools(HermesToolParser, text)
    assert result.content == "<tool_call>oops</tool_call>"
    assert calls_of(result) == [("f", {"x": "y"})]


def test_text_after_the_first_call_is_dropped() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone. <tool_call>bad'
        '</tool_call> <tool_call>{"name": "g", "arguments": {"b": false}}</tool_call> tail'
    )
    result = check_tools(HermesToolParser, text)
    assert result.content is None
    assert calls_of(result) == [("f", {}), ("g", {"b": False})]


def test_whitespace_only_content_before_a_call_is_none() -> None:
    text = '\n\n  <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert check_tools(HermesToolParser, text).content is None


def test_partial_start_tag_is_held_back_until_decided() -> None:
    parser = HermesToolParser(None)
    assert parser.feed("Sure <tool_").content == "Sure"  # the space waits too
    delta = parser.feed("call>")
    assert delta.content is None and delta.tool_calls == []
    delta = parser.feed('{"name": "f", "arguments": {"a": 1}}')
    assert delta.content is None and delta.tool_calls == []  # held until the call closes
    assert not parser.tools_called
    delta = parser.feed("</tool_call>")
    assert parser.tools_called
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, "f", '{"a": 1}')
    ]
    assert parser.finish().content is None

    parser = HermesToolParser(None)
    assert parser.feed("a <tool_").content == "a"
    assert parser.feed("box>").content == " <tool_box>"


def test_extract_leaves_the_streaming_state_alone() -> None:
    parser = HermesToolParser(None)
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.extract(QWEN_TWO_CALLS).content == "Let me check both."
    assert parser.feed("bar").content == " <toolbar"


def test_registered_under_vllm_names() -> None:
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert TOOL_PARSERS["qwen3_json"] is HermesToolParser
