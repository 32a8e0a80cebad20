"""Tool calling and reasoning on /v1/chat/completions, vLLM's way.

- `check_tool_request`: vLLM's request checks (tools non-empty, tool_choice valid and
  naming a declared function, "auto" only with --enable-auto-tool-choice and a parser).
  `tool_choice` defaults to "auto" when tools are given, as in vLLM.
- `forced_call_constraint`: "required" and a named function are enforced by structured
  outputs, as vLLM does: a JSON array of {name, parameters} objects (at least one; at most
  one when parallel_tool_calls is false), or the named function's parameters object, so a
  call is always valid JSON for its schema.
- `ChoiceParser`: one choice's text on its way out, through the reasoning parser (thinking
  -> `reasoning`) and then the tool parser ("auto") or the forced-call reading; `final`
  for a whole output, `feed`/`finish` for a stream. Token ids and logprobs are untouched:
  they cover every generated token, thinking and call syntax included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hotswap.entrypoints.openai.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    DeltaFunctionCall,
    DeltaToolCall,
    ParsedDelta,
    ReasoningParser,
    ToolParser,
    make_tool_call_id,
)
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.sampling_params import StructuredOutputsParams

CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tool_request(body: ChatCompletionRequest, config: ServerConfig) -> None:
    """vLLM's checks, 400 naming the field; sets tool_choice's default ("auto" with
    tools, else "none")."""
    if body.tools is not None and not body.tools:
        raise bad_request("tools: must not be an empty array", "body.tools")
    for i, tool in enumerate(body.tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ...}}}}",
                f"body.tools.{i}.function",
            )
    if body.tool_choice is None:
        body.tool_choice = "auto" if body.tools else "none"
    choice = body.tool_choice
    if choice == "none":
        return
    if not body.tools:
        raise bad_request(
            "tool_choice: when using `tool_choice`, `tools` must be set", "body.tool_choice"
        )
    if isinstance(choice, dict):
        _check_named_choice(choice, body.tools)
    elif choice not in ("auto", "required"):
        raise bad_request(
            f'tool_choice: invalid value {choice!r}; only named tools, "none", "auto" or '
            '"required" are supported',
            "body.tool_choice",
        )
    elif choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise bad_request(
            'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "body.tool_choice",
        )


def _check_named_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(
            f"tool_choice.function: must be an object. {CORRECT_USAGE}",
            "body.tool_choice.function",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"tool_choice.function.name: must be a non-empty string. {CORRECT_USAGE}",
            "body.tool_choice.function.name",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            "tool_choice: the tool specified in `tool_choice` does not match any of the "
            "specified `tools`",
            "body.tool_choice",
        )


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_function(body: ChatCompletionRequest) -> str | None:
    choice = body.tool_choice
    return choice["function"]["name"] if isinstance(choice, dict) else None


def forced_call_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The JSON schema a forced tool call is generated under; None when not forced."""
    name = named_function(body)
    if name is not None:
        tool = next(t for t in body.tools or () if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(tool))
    if body.tool_choice != "required":
        return None
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in body.tools or ()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": calls},
    }
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


@dataclass
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _call_dict(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or make_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ChoiceParser:
    """One choice's output through the configured parsers (see the module docstring)."""

    def __init__(
        self, body: ChatCompletionRequest, config: ServerConfig, thinking: bool = True
    ) -> None:
        self.forced_name = named_function(body)
        self.required = body.tool_choice == "required"
        reasoning = config.reasoning_parser
        self.reasoning: ReasoningParser | None = (
            REASONING_PARSERS[reasoning](enable_thinking=thinking)
            if reasoning and body.include_reasoning
            else None
        )
        auto = body.tool_choice == "auto" and config.tool_call_parser
        self.tools: ToolParser | None = (
            TOOL_PARSERS[config.tool_call_parser](body.tools) if auto else None
        )
        self.forced_text = ""  # a forced call's arguments as they stream
        self.forced_id = make_tool_call_id()
        self.calls_made = False

    @property
    def active(self) -> bool:
        return bool(self.reasoning or self.tools or self.forced_name or self.required)

    def final(self, text: str) -> ParsedMessage:
        reasoning, content = (None, text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        message = ParsedMessage(content=content, reasoning=reasoning)
        if self.forced_name is not None:
            message.tool_calls = [_call_dict(self.forced_name, content or "")]
            message.content = ""
        elif self.required:
            message.tool_calls = _required_calls(content or "")
            message.content = "" if message.tool_calls else content
        elif self.tools is not None:
            extracted = self.tools.extract(content or "")
            if extracted.tools_called:
                message.content = extracted.content
                message.tool_calls = [
                    _call_dict(c.function.name, c.function.arguments, c.id)
                    for c in extracted.tool_calls
                ]
        self.calls_made = bool(message.tool_calls)
        return message

    def feed(self, delta_text: str) -> ParsedDelta:
        out = ParsedDelta(content=delta_text)
        if self.reasoning is not None:
            out = self.reasoning.feed(delta_text)
        return self._after_reasoning(out, final=False)

    def finish(self) -> ParsedDelta:
        out = self.reasoning.finish() if self.reasoning is not None else ParsedDelta()
        return self._after_reasoning(out, final=True)

    def _after_reasoning(self, out: ParsedDelta, final: bool) -> ParsedDelta:
        content = out.content or ""
        if self.forced_name is not None:
            out.content = None
            if content or not self.calls_made:
                out.tool_calls = [self._forced_delta(content)]
        elif self.required:
            self.forced_text += content
            out.content = None
            if final:  # the array, or (cut by max_tokens) its text, as `final` gives it
                out.tool_calls = self._required_deltas()
                out.content = None if out.tool_calls else self.forced_text or None
        elif self.tools is not None:
            parsed = self.tools.feed(content) if content else ParsedDelta()
            if final:
                parsed = merge_deltas(parsed, self.tools.finish())
            out.content, out.tool_calls = parsed.content, parsed.tool_calls
        self.calls_made = self.calls_made or bool(out.tool_calls)
        return out

    def _forced_delta(self, arguments: str) -> DeltaToolCall:
        if self.calls_made:
            return DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))
        return DeltaToolCall(
            index=0,
            id=self.forced_id,
            type="function",
            function=DeltaFunctionCall(name=self.forced_name, arguments=arguments),
        )

    def _required_deltas(self) -> list[DeltaToolCall]:
        """A required choice's calls, whole, when its array is complete (its JSON is only
        known to parse then)."""
        return [
            DeltaToolCall(
                index=i,
                id=call["id"],
                type="function",
                function=DeltaFunctionCall(**call["function"]),
            )
            for i, call in enumerate(_required_calls(self.forced_text))
        ]


def merge_deltas(first: ParsedDelta, second: ParsedDelta) -> ParsedDelta:
    """Two consecutive deltas as one: texts joined, a call's pieces (same index) joined
    into one entry (its id and name from the piece that has them)."""
    content = (first.content or "") + (second.content or "")
    reasoning = (first.reasoning or "") + (second.reasoning or "")
    calls: dict[int, DeltaToolCall] = {}
    for call in [*first.tool_calls, *second.tool_calls]:
        seen = calls.get(call.index)
        if seen is None:
            calls[call.index] = DeltaToolCall(
                index=call.index,
                id=call.id,
                type=call.type,
                function=DeltaFunctionCall(
                    name=call.function.name if call.function else None,
                    arguments=call.function.arguments if call.function else None,
                ),
            )
            continue
        function = seen.function or DeltaFunctionCall()
        piece = call.function or DeltaFunctionCall()
        arguments = (function.arguments or "") + (piece.arguments or "")
        seen.id, seen.type = seen.id or call.id, seen.type or call.type
        seen.function = DeltaFunctionCall(function.name or piece.name, arguments or None)
    return ParsedDelta(
        content=content or None,
        reasoning=reasoning or None,
        tool_calls=list(calls.values()),
    )


def _required_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a "required" output (a JSON array of {name, parameters}); none if it
    does not parse (cut by max_tokens), so the text is returned as content instead."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [
        _call_dict(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def tool_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them (OpenAI's shape, as vLLM passes)."""
    return body.tools or None


def starts_thinking(body: ChatCompletionRequest, config: ServerConfig, prompt_text: str) -> bool:
    """Whether the output begins inside the thinking: a reasoning parser is configured,
    `enable_thinking` is not false, and the rendered prompt has not closed the thinking
    already (Qwen3's template writes an empty think block when thinking is off)."""
    if not config.reasoning_parser or not body.include_reasoning:
        return False
    kwargs = body.chat_template_kwargs or {}
    if kwargs.get("enable_thinking", True) is False:
        return False
    return not REASONING_PARSERS[config.reasoning_parser]().is_reasoning_end(prompt_text)


def gate_constraint_after_thinking(
    constraint: StructuredOutputsParams | None, end_tag_ids: list[int]
) -> None:
    """vLLM's rule for structured outputs with a reasoning parser: the thinking is free,
    the constraint applies from the end-of-thinking tag on."""
    if constraint is not None:
        constraint.start_after_token_ids = list(end_tag_ids)
