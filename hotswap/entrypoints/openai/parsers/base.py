"""Shapes shared by the tool-call and reasoning parsers, and the tool parsers' base class.

Every parser here is a pure text state machine: it is fed detokenized deltas and says what
to emit now. The invariants all of them keep:

- A decision depends only on the text seen so far, never on how it was split into deltas:
  feeding a text in any pieces and then calling `finish()` emits the same content and the
  same calls (names, and arguments once a call's fragments are concatenated) as
  `extract(text)`, which is exactly that on a fresh parser of the same kind.
- Nothing is emitted that a later delta could retract: text that may still turn out to be
  markup (a partial tag, an open call) is held back until it is decided, and a call's
  argument fragments are only text its final arguments string is sure to begin with.
- Nothing raises on model output: a call that does not parse is text, or, when it broke
  after its first delta was sent, closed as sent into a valid JSON object (never retracted).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_MASK_64 = (1 << 64) - 1


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON object, serialized as OpenAI sends it


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall:
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ParsedDelta:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def make_tool_call_id() -> str:
    """`chatcmpl-tool-` and 16 random hex digits, as vLLM 0.32 (`random_uuid()`: the low
    64 bits of a uuid4)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & _MASK_64:016x}"


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (0 if none)."""
    start = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while start >= 0:
        if tag.startswith(text[start:]):
            return len(text) - start
        start = text.find(tag[0], start + 1)
    return 0


def is_json_finite(value: Any) -> bool:
    """Whether `value` serializes to valid JSON (no inf or nan anywhere in it)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(is_json_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(is_json_finite(v) for v in value)
    return True


def tool_properties(tools: list[Any], name: str) -> dict[str, Any]:
    """The JSON-schema `properties` of the request tool called `name` ({} if unknown).
    Tools are OpenAI's `{"type": "function", "function": {"name", "parameters"}}`, as dicts
    or as models with `model_dump()`."""
    for tool in tools:
        if not isinstance(tool, Mapping) and hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or function.get("name") != name:
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        return dict(properties) if isinstance(properties, Mapping) else {}
    return {}


class ToolParser:
    """Base of the tool-call parsers. A subclass implements `_advance(eof)`, which consumes
    `self._buf` as far as it is decided and reports through `_text`, `_start_call` and
    `_call_arguments`.

    Output rules (all parsers, streamed and not alike):
    - a call streams as vLLM streams one: its first delta carries index, id, type
      "function" and the name (only once the name is whole and certain), later deltas only
      the index and fragments of the arguments; the fragments, concatenated, are the
      arguments JSON object `extract` returns. Deltas of one call decided by the same feed
      are sent as one (the first may carry a name and a fragment);
    - content is the text before the first call, its trailing whitespace dropped when a call
      follows (so whitespace-only content before a call is None); text after the first call
      is dropped, as vLLM's hermes parser does; with no call the content is the whole text,
      verbatim (None when empty);
    - malformed calls are text, unless they broke after their first delta was sent: a call
      is never retracted; each parser says how it closes such a call.
    """

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools: list[Any] = list(tools or [])
        self._buf = ""  # received, not yet decided
        self._held_ws = ""  # trailing whitespace of the content, held until non-space follows
        self._n_calls = 0  # calls started
        self._out_content: list[str] = []
        self._out_calls: list[DeltaToolCall] = []

    @property
    def tools_called(self) -> bool:
        """Whether this stream emitted a call so far (finish_reason "tool_calls")."""
        return self._n_calls > 0

    def extract(self, text: str) -> ExtractedToolCalls:
        """Calls and content of a whole output (this parser's streaming state untouched)."""
        fresh = type(self)(self.tools)
        deltas = (fresh.feed(text), fresh.finish())
        content = "".join(d.content or "" for d in deltas)
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            for call in delta.tool_calls:
                function = call.function or DeltaFunctionCall()
                if call.index not in calls:
                    first = FunctionCall(function.name or "", "")
                    calls[call.index] = ToolCall(call.id or "", first)
                calls[call.index].function.arguments += function.arguments or ""
        return ExtractedToolCalls(bool(calls), list(calls.values()), content or None)

    def feed(self, delta_text: str) -> ParsedDelta:
        """One detokenized delta in; the content and call deltas decided by it out."""
        self._buf += delta_text
        self._advance(eof=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of output: everything still held back is decided (an open call is text, or,
        if it started, is closed)."""
        self._advance(eof=True)
        if self._buf:  # a subclass left text undecided at eof: it is content
            self._text(self._buf)
            self._buf = ""
        if self._held_ws and not self._n_calls:
            self._out_content.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    def _advance(self, eof: bool) -> None:
        raise NotImplementedError

    def _text(self, text: str) -> None:
        """Report text outside calls (dropped once a call was emitted)."""
        if self._n_calls or not text:
            return
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            self._out_content.append(body)

    def _start_call(self, name: str) -> None:
        """Report the start of the next call: its index, a new id and its (whole) name."""
        self._held_ws = ""
        self._out_calls.append(
            DeltaToolCall(
                index=self._n_calls,
                id=make_tool_call_id(),
                type="function",
                function=DeltaFunctionCall(name=name),
            )
        )
        self._n_calls += 1

    def _call_arguments(self, fragment: str) -> None:
        """Report the next fragment of the arguments of the call started last."""
        if not fragment:
            return
        last = self._out_calls[-1] if self._out_calls else None
        if last is not None and last.index == self._n_calls - 1 and last.function is not None:
            last.function.arguments = (last.function.arguments or "") + fragment
            return
        self._out_calls.append(
            DeltaToolCall(index=self._n_calls - 1, function=DeltaFunctionCall(arguments=fragment))
        )

    def _take(self) -> ParsedDelta:
        content = "".join(self._out_content) or None
        delta = ParsedDelta(content=content, tool_calls=self._out_calls)
        self._out_content, self._out_calls = [], []
        return delta
