"""An SSE event stays one line for line splitters that follow str.splitlines (httpx's
iter_lines): the Unicode line breaks JSON leaves raw inside strings are escaped."""

from __future__ import annotations

import json

from hotswap.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from hotswap.entrypoints.openai.streaming import sse


def test_unicode_line_breaks_are_escaped_in_events() -> None:
    text = "a\u2028b\x85c\u2029d\ne"
    chunk = CompletionResponse(
        id="x", created=0, model="m", choices=[CompletionChoice(index=0, text=text)]
    )
    event = sse(chunk)
    lines = event.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["text"] == text
