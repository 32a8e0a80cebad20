"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3)."""

from __future__ import annotations

import json

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, HermesToolParser
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools, streamed_so_far

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
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": "f", "arguments": "{"}</tool_call>',  # a string, not an object
        '<tool_call>{"name": 1, "arguments": {}}</tool_call>',  # a name not a string
        '<tool_call>{"arguments": {"a": 1}, "name": "f</tool_call>',  # name last, cut off
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>',  # bad JSON before the start
        '<tool_call>x{"name": "f", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f", {}]</tool_call>',  # not an object
        "<tool_call>",  # only the tag
        "<tool_call>\n</tool_call>",
    ],
)
def test_malformed_call_is_content(call: str) -> None:
    text = "Calling.\n" + call + "\n"
    result = check_tools(HermesToolParser, text)
    assert not result.tools_called
    assert result.content == text


@pytest.mark.parametrize(
    ("call", "arguments"),
    [
        ('{"name": "f", "arguments": {</tool_call>', "{}"),  # bad JSON after the start
        ('{"name": "f", "arguments": {"a": NaN}}</tool_call>', "{}"),  # no JSON for nan
        ('{"name": "f", "arguments": {"a": 1, "b": 1e999}}</tool_call>', '{"a": 1}'),  # inf
        ('{"name": "f", "arguments": {"a": 1}', '{"a": 1}'),  # cut off, arguments whole
        ('{"name": "f", "arguments": {"a": 12', '{"a": 12}'),  # the end ends the number
        ('{"name": "f", "arguments": {"a": [tr', '{"a": []}'),  # a cut literal is dropped
        ('{"name": "f", "arguments": {"a": "caf\\u00e', '{"a": "caf"}'),  # and an escape
        ('{"name": "f", "arguments": {"a": "x\\n\\t</tool_call>', '{"a": "x\\n\\t"}'),
        ('{"name": "f", "arguments": {"a": "x\ny"}}', '{"a": "x"}'),  # a raw line break
        ('{"name": "f", "arguments": {"a": {"b": ', '{"a": {}}'),  # a key without value
        ('{"name": "f", "arguments": {"a": 1} "oops"}</tool_call>', '{"a": 1}'),
        ('{"name": "f", "arguments": {"a": 1}, "name": 7}', '{"a": 1}'),  # first name wins
    ],
)
def test_malformed_after_the_start_stays_as_sent_closed(call: str, arguments: str) -> None:
    """The name and the opened arguments were sent: the call is not retracted but closed
    where it broke, and `extract` says the same."""
    result = check_tools(HermesToolParser, "Calling.\n<tool_call>" + call + " tail")
    assert result.content == "Calling."
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("f", arguments)
    ]


def test_arguments_stream_as_they_are_generated() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", '
        '"days": 12, "ok": true, "note": "caf\\u00e9 \\"x\\"", "tags": ["a"]}}\n</tool_call>'
    )
    seen = streamed_so_far(HermesToolParser, text)

    def at(marker: str, offset: int = 0) -> list[tuple[str, str]]:
        """What was streamed once `text` up to the end of `marker` was fed."""
        return seen[text.index(marker) + len(marker) + offset]

    assert at('"get_weath') == [] and at('"get_weather"') == []  # a name alone: not yet
    assert at('"arguments": {') == [("get_weather", "{")]
    assert at('"San Fr') == [("get_weather", '{"city": "San Fr')]
    assert at('"days": 1') == at('"days": 12') == [("get_weather", '{"city": "San Francisco"')]
    assert at('"days": 12,') == [("get_weather", '{"city": "San Francisco", "days": 12')]
    assert at('"ok": tr')[0][1].endswith('"days": 12')
    assert at('"ok": true')[0][1].endswith('"days": 12, "ok": true')
    assert at('"caf\\u00')[0][1].endswith('"note": "caf')  # an escape only when whole
    assert at('"caf\\u00e9')[0][1].endswith('"note": "café')
    assert at('\\"x')[0][1].endswith('"note": "café \\"x')
    assert at('["a"]')[0][1].endswith('"tags": ["a"]')  # the object still open
    final = (
        '{"city": "San Francisco", "days": 12, "ok": true, "note": "café \\"x\\"", "tags": ["a"]}'
    )
    assert at('["a"]}') == [("get_weather", final)]
    assert calls_of(check_tools(HermesToolParser, text))[0][1]["note"] == 'café "x"'


def test_surrogate_pairs_join_as_json_loads_joins_them() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"s": "\\ud83d\\ude00 \\ud800x"}}</tool_call>'
    seen = streamed_so_far(HermesToolParser, text)
    cut = text.index("\\ude00")
    assert seen[cut + 4][0][1] == '{"s": "'  # the high half waits for a low one
    arguments = check_tools(HermesToolParser, text).tool_calls[0].function.arguments
    assert arguments == json.dumps({"s": "\U0001f600 \ud800x"}, ensure_ascii=False)


def test_arguments_before_the_name_are_sent_with_it() -> None:
    text = '<tool_call>{"arguments": {"a": [1, 2.50]}, "name": "f"}</tool_call>'
    seen = streamed_so_far(HermesToolParser, text)
    assert seen[text.index('"name"')] == []
    assert seen[text.index('"f"') + 3] == [("f", '{"a": [1, 2.5]}')]
    assert calls_of(check_tools(HermesToolParser, text)) == [("f", {"a": [1, 2.5]})]


def test_duplicate_keys_are_kept_in_order() -> None:
    """A key's first value was sent before the second arrives: both stay, and a JSON reader
    keeps the last, as vLLM's non-streamed dict does."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": {"c": 2, "c": 3}, "a": 4}}'
    arguments = check_tools(HermesToolParser, text).tool_calls[0].function.arguments
    assert arguments == '{"a": 1, "b": {"c": 2, "c": 3}, "a": 4}'
    assert json.loads(arguments) == {"a": 4, "b": {"c": 3}}


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
    delta = parser.feed('{"name": "f", "arguments"')
    assert delta.content is None and delta.tool_calls == []  # held until the call starts
    assert not parser.tools_called
    delta = parser.feed(': {"a": 1')
    assert parser.tools_called
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, "function", "f", "{")  # the number may go on
    ]
    delta = parser.feed("}}")
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, None, None, '"a": 1}')
    ]
    assert parser.feed("</tool_call>").tool_calls == []
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
