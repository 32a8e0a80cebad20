"""`hermes` (Hermes 2 Pro, Qwen2.5, QwQ, Qwen3; vLLM's alias `qwen3_json`):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "SF"}}
    </tool_call>

one JSON object per region, several regions allowed. As vLLM's Hermes2ProToolParser: the
body is `json.loads`ed whole (strict JSON), "name" and "arguments" are required, the
arguments are re-serialized with `json.dumps(..., ensure_ascii=False)`, and a region left
open at the end of the output still counts when its body is already complete JSON.
"""

from __future__ import annotations

import json

from hotswap.entrypoints.openai.parsers.base import json_call
from hotswap.entrypoints.openai.parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    def _parse_region(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = json_call(obj, ("arguments",))
        return [call] if call else None
