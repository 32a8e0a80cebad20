"""`hermes` (Hermes 2 Pro, Qwen2.5, QwQ, Qwen3; vLLM's alias `qwen3_json`):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "SF"}}
    </tool_call>

one JSON object per region, several regions allowed, "name" and "arguments" required, the
arguments re-serialized in `json.dumps(..., ensure_ascii=False)` form, as vLLM's
Hermes2ProToolParser. The call streams as it is generated (`json_calls`): the name once
whole and the arguments object opened, then the arguments as far as they are decided (a
string's characters as they come, a number once it ends, a closing bracket once read).
Malformed before that point, the region is text; after it, the call stays as sent and is
closed where it broke (`{"name": "f", "arguments": {"a": 1` at the end of the output is
f with `{"a": 1}`), and the rest of the region is ignored. A region left open at the end of
the output still counts when its arguments closed; text after the object in the region is
ignored.
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.json_calls import JsonCallStream
from hotswap.entrypoints.openai.parsers.partial_json import OPEN
from hotswap.entrypoints.openai.parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._reader = JsonCallStream(self, ("arguments",))

    def _region_open(self) -> None:
        self._reader = JsonCallStream(self, ("arguments",))

    def _region_feed(self, body: str) -> None:
        if self._reader.state == OPEN:  # once the object closed or broke, the rest is ignored
            self._reader.feed(body)

    def _region_close(self, closed: bool) -> None:
        self._reader.finish()
