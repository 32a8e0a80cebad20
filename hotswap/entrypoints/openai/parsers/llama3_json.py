"""`llama3_json` (Llama 3.1-3.3 and 4 JSON tool calls; vLLM's alias `llama4_json`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}; {"name": ...}

The output is calls only when, after leading whitespace, it starts with `<|python_tag|>` or
`{` (vLLM's streaming test): then it is JSON objects, separated by whitespace and at most one
`;` each, every one with a non-empty string "name" and an "arguments" or "parameters"
object (the first of the two in the object; vLLM's non-streamed path prefers "arguments",
its streamed one rejects an object with both); the arguments are re-serialized in
`json.dumps(..., ensure_ascii=False)` form, and the content is None.

Each call streams as it is generated (`json_calls`): the name once whole and the arguments
object opened, then the arguments as far as they are decided. If anything fails before the
first call started (not JSON, a key missing, an object cut off at the end of the output)
the whole output is content. A failure after a call started drops the rest of the output,
the call that broke staying as sent, closed where it broke.
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.base import ToolParser
from hotswap.entrypoints.openai.parsers.json_calls import JsonCallStream
from hotswap.entrypoints.openai.parsers.partial_json import DONE, OPEN


class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    argument_keys = ("arguments", "parameters")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"  # start | between | object | text | drop
        self._raw: list[str] = []  # consumed text, content again if no call starts
        self._separated = False  # a `;` was seen since the last object
        self._reader = JsonCallStream(self, self.argument_keys)

    def _advance(self, eof: bool) -> None:
        steps = {"start": self._start, "between": self._between, "object": self._object}
        while self._mode in steps:
            if not steps[self._mode](eof):
                return
        if self._mode == "text":
            self._text(self._buf)
        self._buf = ""  # "drop": after a call that broke, the rest is dropped

    def _consume(self, n: int) -> None:
        if not self._n_calls:  # after the first call nothing becomes content again
            self._raw.append(self._buf[:n])
        self._buf = self._buf[n:]

    def _fail(self) -> None:
        """No call started, and it is not calls after all: everything is content."""
        self._buf = "".join(self._raw) + self._buf
        self._raw = []
        self._mode = "text"

    def _start(self, eof: bool) -> bool:
        """Decide from the first non-space characters whether the output is calls."""
        rest = self._buf.lstrip()
        skipped = len(self._buf) - len(rest)
        if rest.startswith(self.bot_token):
            self._consume(skipped + len(self.bot_token))
            self._mode = "between"
        elif rest.startswith("{"):
            self._consume(skipped)
            self._mode = "between"
        elif not eof and self.bot_token.startswith(rest):  # empty or a partial tag: wait
            return False
        else:
            self._mode = "text"
        return True

    def _between(self, eof: bool) -> bool:
        """Whitespace and at most one `;` until the next object opens."""
        rest = self._buf.lstrip()
        self._consume(len(self._buf) - len(rest))
        if not rest:
            if eof and not self._n_calls:  # only a python tag: no call
                self._fail()
                return True
            return False
        if rest[0] == "{":
            self._mode, self._separated = "object", False
            self._reader = JsonCallStream(self, self.argument_keys)
        elif rest[0] == ";" and self._n_calls and not self._separated:
            self._consume(1)
            self._separated = True
        else:
            self._broke()
        return True

    def _object(self, eof: bool) -> bool:
        """Stream the open object's call; when it closes, the next object may follow."""
        reader = self._reader
        self._consume(reader.feed(self._buf))
        if reader.state == OPEN:
            if not eof:
                return False
            reader.finish()
        if reader.state == DONE and reader.started:
            self._mode = "between"
        else:
            self._broke()
        return True

    def _broke(self) -> None:
        """Not a call here: all content before the first call, else the rest is dropped."""
        if self._n_calls:
            self._mode = "drop"
        else:
            self._fail()
