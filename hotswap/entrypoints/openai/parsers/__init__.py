"""Tool-call and reasoning parsers for the chat route: pure text state machines keyed by
vLLM's `--tool-call-parser` and `--reasoning-parser` names.

Use: one parser instance per output (per choice). Streaming: `feed(delta_text)` for each
detokenized delta, then `finish()`; non-streaming: `extract(text)`. Feeding a text in any
pieces emits exactly what `extract` returns for it (see `base`). Run the reasoning parser
first and give the tool parser its content.

Tool calls stream as vLLM streams them: a call's first DeltaToolCall carries its index, id,
type and name, later ones (same index) fragments of its arguments, whose concatenation is
the arguments string `extract` returns. A consumer that merges deltas must join fragments
by index. What streams when, per parser: hermes and llama3_json (`json_calls`,
`partial_json`) the arguments as far as decided, character by character in strings;
qwen3_coder one whole parameter at a time; pythonic one whole keyword argument at a time.
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.base import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ParsedDelta,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from hotswap.entrypoints.openai.parsers.hermes import HermesToolParser
from hotswap.entrypoints.openai.parsers.llama3_json import Llama3JsonToolParser
from hotswap.entrypoints.openai.parsers.pythonic import PythonicToolParser
from hotswap.entrypoints.openai.parsers.qwen3_coder import Qwen3CoderToolParser
from hotswap.entrypoints.openai.parsers.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,  # vLLM 0.32's alias
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM 0.32's alias
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's alias
    "pythonic": PythonicToolParser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeepSeekR1ReasoningParser",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedDelta",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ToolCall",
    "ToolParser",
    "make_tool_call_id",
]
