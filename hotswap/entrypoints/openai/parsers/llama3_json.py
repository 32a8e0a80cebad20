"""`llama3_json` (Llama 3.1-3.3 and 4 JSON tool calls; vLLM's alias `llama4_json`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}; {"name": ...}

The output is calls only when, after leading whitespace, it starts with `<|python_tag|>` or
`{` (vLLM's streaming test): then it is JSON objects, separated by whitespace and at most one
`;` each, every one with a non-empty string "name" and an "arguments" (else "parameters")
object; the arguments are re-serialized with `json.dumps(..., ensure_ascii=False)`, and the
content is None. Each call is emitted as soon as its object closes. If anything before the
first call fails (not JSON, a key missing, an object cut off at the end of the output) the
whole output is content; a failure after a call drops the rest of the output.
"""

from __future__ import annotations

import json

from hotswap.entrypoints.openai.parsers.base import ToolParser, json_call


class JsonObjectScanner:
    """Finds where the JSON value opening at offset 0 of a growing text closes, scanning
    every character once however the text arrives (strings and escapes respected)."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end(self, text: str) -> int:
        """The offset just past the value's closing bracket, or -1 while it is open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        self.pos = len(text)
        return -1


class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    argument_keys = ("arguments", "parameters")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"  # start | between | object | text
        self._raw = ""  # consumed text that becomes content if no call comes of it
        self._object_head: list[str] = []  # the open object's scanned text before `_buf`
        self._separated = False  # a `;` was seen since the last object
        self._scanner = JsonObjectScanner()

    def _advance(self, eof: bool) -> None:
        steps = {"start": self._start, "between": self._between, "object": self._object}
        while self._mode != "text":
            if not steps[self._mode](eof):
                return
        self._text(self._buf)
        self._buf = ""

    def _consume(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _fail(self) -> None:
        """Not calls after all: what was consumed is content again, and so is the rest."""
        self._buf = self._raw + "".join(self._object_head) + self._buf
        self._raw, self._object_head = "", []
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
            self._mode, self._scanner, self._separated = "object", JsonObjectScanner(), False
        elif rest[0] == ";" and self._n_calls and not self._separated:
            self._consume(1)
            self._separated = True
        else:
            self._fail()
        return True

    def _object(self, eof: bool) -> bool:
        """Wait for the open object to close, then it is a call or a failure."""
        end = self._scanner.end(self._buf)
        if end < 0:
            if eof:
                self._fail()
                return True
            self._object_head.append(self._buf)  # scanned: out of the growing buffer
            self._buf, self._scanner.pos = "", 0
            return False
        text = "".join(self._object_head) + self._buf[:end]
        try:
            call = json_call(json.loads(text), self.argument_keys)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            call = None
        if call is None:
            self._fail()
            return True
        self._buf, self._raw, self._object_head = self._buf[end:], "", []
        self._call(*call)
        self._mode = "between"
        return True
