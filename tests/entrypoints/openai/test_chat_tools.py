"""The chat route's tool and reasoning pipeline on crafted outputs (no engine): request
checks, forced-call schemas, and one choice's text through reasoning then tool parsing,
whole and streamed at every split point."""

from __future__ import annotations

import json

import pytest

from hotswap.entrypoints.openai.chat_tools import (
    ChoiceParser,
    check_tool_request,
    forced_call_constraint,
    merge_deltas,
    starts_thinking,
)
from hotswap.entrypoints.openai.parsers import ParsedDelta
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest
from hotswap.entrypoints.server.errors import APIError
from hotswap.entrypoints.server.state import ServerConfig

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
AGENT = ServerConfig(
    served_model_name="m",
    enable_auto_tool_choice=True,
    tool_call_parser="hermes",
    reasoning_parser="qwen3",
)
MESSAGES = [{"role": "user", "content": "hi"}]


def request(**fields) -> ChatCompletionRequest:  # noqa: ANN003
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    check_tool_request(body, AGENT)
    return body


def streamed(parser: ChoiceParser, pieces: list[str]) -> ParsedDelta:
    out = ParsedDelta()
    for piece in pieces:
        out = merge_deltas(out, parser.feed(piece))
    return merge_deltas(out, parser.finish())


OUTPUT = (
    '<think>\nlet me look</think>\n\nSure.<tool_call>\n{"name": "lookup", '
    '"arguments": {"key": "a"}}\n</tool_call>'
)


def test_reasoning_then_auto_tool_call_whole_and_streamed() -> None:
    body = request(tools=[TOOL])
    whole = ChoiceParser(body, AGENT, thinking=True).final(OUTPUT)
    assert whole.reasoning == "\nlet me look"
    assert whole.content == "\n\nSure."
    (call,) = whole.tool_calls
    assert call["function"] == {"name": "lookup", "arguments": '{"key": "a"}'}
    for cut in range(1, len(OUTPUT)):
        parser = ChoiceParser(body, AGENT, thinking=True)
        out = streamed(parser, [OUTPUT[:cut], OUTPUT[cut:]])
        assert out.reasoning == whole.reasoning, cut
        assert out.content == whole.content, cut
        assert [c.function.arguments for c in out.tool_calls] == ['{"key": "a"}'], cut
        assert parser.calls_made


def test_thinking_off_leaves_everything_to_the_tool_parser() -> None:
    parser = ChoiceParser(request(tools=[TOOL]), AGENT, thinking=False)
    message = parser.final("<think>x</think>plain")
    assert message.reasoning is None and message.content == "<think>x</think>plain"


def test_named_call_streams_its_arguments_under_one_id() -> None:
    body = request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}})
    arguments = '{"key": "abc"}'
    parser = ChoiceParser(body, AGENT, thinking=False)
    deltas = [parser.feed(ch) for ch in arguments] + [parser.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].id and calls[0].function.name == "lookup"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == arguments
    assert not any(d.content for d in deltas)
    whole = ChoiceParser(body, AGENT, thinking=False).final(arguments)
    assert whole.tool_calls[0]["function"]["arguments"] == arguments and whole.content == ""


def test_required_calls_parse_the_array_or_fall_back_to_content() -> None:
    body = request(tools=[TOOL], tool_choice="required")
    text = '[{"name": "lookup", "parameters": {"key": "é"}}]'
    message = ChoiceParser(body, AGENT, thinking=False).final(text)
    assert json.loads(message.tool_calls[0]["function"]["arguments"]) == {"key": "é"}
    cut = ChoiceParser(body, AGENT, thinking=False).final(text[:20])  # max_tokens hit
    assert cut.tool_calls == [] and cut.content == text[:20]
    parser = ChoiceParser(body, AGENT, thinking=False)
    out = streamed(parser, [text[:10], text[10:]])
    assert [c.function.name for c in out.tool_calls] == ["lookup"]
    cut_stream = streamed(ChoiceParser(body, AGENT, thinking=False), [text[:8], text[8:20]])
    assert cut_stream.tool_calls == [] and cut_stream.content == text[:20]  # as `final`


def test_forced_call_schemas() -> None:
    named = request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert forced_call_constraint(named).json == TOOL["function"]["parameters"]
    required = request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = forced_call_constraint(required).json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {
        "type": "string",
        "enum": ["lookup"],
    }
    assert forced_call_constraint(request(tools=[TOOL])) is None  # auto


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": []}, "body.tools"),
        ({"tool_choice": "auto"}, "body.tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "body.tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "body.tool_choice.function"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}},
            "body.tool_choice.function.name",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        request(**fields)
    assert caught.value.param == param


def test_auto_needs_the_server_flags_and_defaults() -> None:
    plain = ServerConfig(served_model_name="m")
    body = ChatCompletionRequest(messages=MESSAGES, tools=[TOOL])
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        check_tool_request(body, plain)
    assert body.tool_choice == "auto"  # vLLM's default with tools
    none = ChatCompletionRequest(messages=MESSAGES, tools=[TOOL], tool_choice="none")
    check_tool_request(none, plain)
    assert ChoiceParser(none, plain).final("<tool_call>").tool_calls == []


def test_starts_thinking_follows_the_rendered_prompt() -> None:
    body = request()
    assert starts_thinking(body, AGENT, "<|im_start|>assistant\n")
    assert not starts_thinking(body, AGENT, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    off = request(chat_template_kwargs={"enable_thinking": False})
    assert not starts_thinking(off, AGENT, "<|im_start|>assistant\n")
    assert not starts_thinking(body, ServerConfig(served_model_name="m"), "x")
