"""`qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter></function>`, the
values typed by the request's tool schema as vLLM 0.32 types them."""

from __future__ import annotations

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, Qwen3CoderToolParser
from hotswap.entrypoints.openai.parsers.qwen3_coder import coerce, schema_types
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools, streamed_so_far

PROPERTIES = {
    "city": {"type": "string"},
    "zip": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "whole": {"type": "number"},
    "metric": {"type": "boolean"},
    "filters": {"type": "object"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "limit": {"type": ["integer", "null"]},
    "level": {"enum": [1, 2, 3]},
    "count": {"type": "integer"},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": PROPERTIES},
        },
    },
    {"type": "function", "function": {"name": "no_schema"}},
]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_values_typed_by_the_schema() -> None:
    text = "I'll look it up.\n\n" + call(
        "get_weather",
        city="San Francisco",
        zip="02134",  # a string stays a string, leading zero and all
        days="3",
        ratio="2.5",
        whole="3.0",  # a whole number becomes an integer, as vLLM
        metric="True",
        filters='{"rain": true, "max": [1, 2]}',
        tags='["a", "b"]',
        limit="null",
        level="2",
        count="many",  # fits no type: stays the string
        extra="5",  # not in the schema: a string
    )
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert result.content == "I'll look it up."
    assert calls_of(result) == [
        (
            "get_weather",
            {
                "city": "San Francisco",
                "zip": "02134",
                "days": 3,
                "ratio": 2.5,
                "whole": 3,
                "metric": True,
                "filters": {"rain": True, "max": [1, 2]},
                "tags": ["a", "b"],
                "limit": None,
                "level": 2,
                "count": "many",
                "extra": "5",
            },
        )
    ]


def test_without_a_schema_every_value_is_a_string() -> None:
    for tools in (TOOLS, None):
        result = check_tools(Qwen3CoderToolParser, call("no_schema", n="3", b="true"), tools)
        assert calls_of(result) == [("no_schema", {"n": "3", "b": "true"})]


def test_multiline_value_keeps_its_inner_newlines() -> None:
    code = "  # indented\ndef f():\n    return '<b>'\n\n"  # only the markup newlines go
    text = call("write_file", path="a.py", content=code)
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert calls_of(result) == [("write_file", {"path": "a.py", "content": code})]


def test_several_calls_in_regions_and_in_one_region() -> None:
    text = (
        call("get_weather", city="SF", days="1")
        + "\n"
        + "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "<function=b>\n</function>\n</tool_call>"
    )
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert result.content is None
    assert calls_of(result) == [
        ("get_weather", {"city": "SF", "days": 1}),
        ("a", {"x": "1"}),
        ("b", {}),
    ]


def test_missing_parameter_end_tags_are_tolerated() -> None:
    text = "<tool_call><function=f><parameter=a>1<parameter=b>two\n</function></tool_call>"
    assert calls_of(check_tools(Qwen3CoderToolParser, text)) == [("f", {"a": "1", "b": "two"})]
    text = "<tool_call><function=f><parameter=a</function>"  # a parameter never named
    assert calls_of(check_tools(Qwen3CoderToolParser, text)) == [("f", {})]


def test_missing_end_tag_between_calls_is_tolerated() -> None:
    text = "<tool_call><function=f></function>\n<tool_call><function=g></function></tool_call>"
    assert calls_of(check_tools(Qwen3CoderToolParser, text)) == [("f", {}), ("g", {})]


def test_region_open_at_the_end_counts_once_its_function_closed() -> None:
    text = "Ok\n" + call("get_weather", days="2").removesuffix("</tool_call>")
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert result.content == "Ok" and calls_of(result) == [("get_weather", {"days": 2})]


@pytest.mark.parametrize(
    "region",
    [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n",  # cut off inside a parameter
        "<tool_call>\n<function=f>",  # cut off after the name
        "<tool_call>\n</tool_call>",  # no function
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # hermes JSON
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\nhmm <function=f>\n</function>\n</tool_call>",  # text in the region
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call> <function=g></function>",
    ],
)
def test_malformed_call_is_content(region: str) -> None:
    text = "Calling:\n" + region
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert not result.tools_called and result.content == text


def test_each_parameter_streams_once_it_closes() -> None:
    text = "Ok.\n" + call("get_weather", city="San Francisco", days="3", tags='["a"]')
    seen = streamed_so_far(Qwen3CoderToolParser, text, TOOLS)
    assert seen[text.index("San Fr")] == []  # the name waits for the first parameter
    first = text.index("</parameter>")
    assert seen[first + len("</parameter")] == []
    assert seen[first + len("</parameter>")] == [("get_weather", '{"city": "San Francisco"')]
    second = text.index("</parameter>", first + 1) + len("</parameter>")
    assert seen[second] == [("get_weather", '{"city": "San Francisco", "days": 3')]
    end = text.index("</function>") + len("</function>")
    final = '{"city": "San Francisco", "days": 3, "tags": ["a"]}'
    assert seen[end - 1][0][1] != final and seen[end] == [("get_weather", final)]
    result = check_tools(Qwen3CoderToolParser, text, TOOLS)
    assert result.tool_calls[0].function.arguments == final


def test_a_value_ends_at_the_next_parameter_or_the_function_end_too() -> None:
    text = "<tool_call><function=f><parameter=a>1<parameter=b>x\n</function>"
    seen = streamed_so_far(Qwen3CoderToolParser, text)
    assert seen[text.index("<parameter=b>")] == []  # `<parameter=` might be text still
    assert seen[text.index("<parameter=b>") + len("<parameter=")] == [("f", '{"a": "1"')]
    assert seen[-1] == [("f", '{"a": "1", "b": "x"}')]


def test_a_function_without_parameters_starts_at_its_end() -> None:
    text = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    seen = streamed_so_far(Qwen3CoderToolParser, text)
    assert seen[text.index("</function>") + 10] == []
    assert seen[text.index("</function>") + 11] == [("get_time", "{}")]


@pytest.mark.parametrize(
    ("region", "arguments"),
    [
        # cut off inside the second parameter: the first was sent, the second is dropped
        (
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx",
            '{"a": "1"}',
        ),
        ("<tool_call><function=f><parameter=a>1</parameter></tool_call>", '{"a": "1"}'),
        ("<tool_call><function=f><parameter=a>1</parameter>", '{"a": "1"}'),
        ("<tool_call><function=f></function> junk <function=g></function></tool_call>", "{}"),
        ("<tool_call><function=f></function><function=></function></tool_call>", "{}"),
        # a parameter named twice is sent twice; a JSON reader keeps the last
        ("<tool_call><function=f><parameter=a>1<parameter=a>2</function>", '{"a": "1", "a": "2"}'),
    ],
)
def test_malformed_after_the_start_stays_as_sent_closed(region: str, arguments: str) -> None:
    result = check_tools(Qwen3CoderToolParser, "Calling:\n" + region)
    assert result.content == "Calling:"
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("f", arguments)
    ]


def test_schema_types_and_coercion_rules() -> None:
    assert schema_types(None) == {"string"}
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert schema_types({"enum": ["a", True, None, 1.5]}) == {"string", "boolean", "null", "number"}
    assert coerce("null", {"string"}) == "null"  # null only where the schema allows it
    assert coerce("NULL", {"string", "null"}) is None
    assert coerce("1", {"boolean"}) is True
    assert coerce("yes", {"boolean"}) == "yes"
    assert coerce("7", {"int"}) == 7  # vLLM's type aliases
    assert coerce("1e999", {"number"}) == "1e999"  # no JSON for inf
    assert coerce("[1, 2]", {"object"}) == [1, 2]  # JSON that parses, as vLLM
    assert coerce("4.5", {"integer"}) == 4.5  # no type fits: JSON if it parses


def test_registered_under_vllm_names() -> None:
    assert TOOL_PARSERS["qwen3_coder"] is Qwen3CoderToolParser
    assert TOOL_PARSERS["qwen3_xml"] is Qwen3CoderToolParser
