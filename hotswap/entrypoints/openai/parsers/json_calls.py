"""One JSON call object, `{"name": "f", "arguments": {...}}`, streamed as it is generated
(hermes, llama3_json).

`JsonCallStream` reads the object as its text arrives and reports its call to a
`ToolParser` the way vLLM streams one: a first delta with the name, then the arguments in
fragments. Rules:
- The call starts (its first delta is sent) once the name is a whole, non-empty string
  and the arguments object has opened; the arguments are then sent as `JsonWriter` writes
  them (see `partial_json`): the concatenated fragments are the arguments re-serialized in
  `json.dumps(..., ensure_ascii=False)` form. If the arguments come before the name, they
  are held and sent with it.
- The first "name" member is the name and must be a non-empty string; the first member
  whose key is one of the argument keys is the arguments and must be an object or a string
  holding one (sent whole once the string closes). Later duplicates of either are
  read as JSON and ignored; so are other members.
- A call is complete when its arguments object closes: nothing after it can change it.
- Malformed after the start (bad JSON, NaN, the text ends with the object open): the call
  stays as sent and is closed where it broke: the written arguments get the quote and
  brackets that make them valid JSON (`{"a": "par` -> `{"a": "par"}`; a number or key cut
  off is dropped). Malformed before the start: no call (`started` stays False).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from hotswap.entrypoints.openai.parsers.partial_json import (
    COLON,
    COMMA_OR_END,
    DONE,
    FAILED,
    KEY,
    KEY_OR_END,
    OPEN,
    VALUE,
    JsonWriter,
    canonical_object,
)

if TYPE_CHECKING:
    from hotswap.entrypoints.openai.parsers.base import ToolParser

_START = -1  # nothing read yet: the object's `{` comes next
_SPACES = frozenset(" \t\n\r")


class JsonCallStream:
    """Reads one call object; `state` OPEN until the object closes (DONE) or breaks or the
    input ends with it open (FAILED). `started`: the call's first delta was sent;
    `complete`: its last. Once the state is not OPEN, started implies complete."""

    def __init__(self, parser: ToolParser, argument_keys: tuple[str, ...]) -> None:
        self.state = OPEN
        self.started = False
        self.complete = False
        self._parser = parser
        self._argument_keys = argument_keys
        self._expect = _START
        self._member: JsonWriter | None = None  # the key or value being read
        self._role = ""  # what the member is: "key", "name", "arguments", or "" (ignored)
        self._seen: set[str] = set()  # roles already filled
        self._key = ""
        self._name: str | None = None
        self._arguments: JsonWriter | None = None

    def feed(self, text: str, pos: int = 0) -> int:
        """Read `text[pos:]`; the offset where reading stopped: the end of the text, or just
        past the object's `}`, or at the character that broke it."""
        while pos < len(text) and self.state == OPEN:
            if self._member is None:
                pos = self._structure(text, pos)
                continue
            pos = self._member.feed(text, pos)
            if self._role == "arguments" and self._member.kind not in ("", "{", '"'):
                self._fail()  # arguments that are not an object
            elif self._member.state != OPEN:
                self._member_done()
        self._pump()
        return pos

    def finish(self) -> None:
        """End of the input with the object still open: it failed."""
        if self.state != OPEN:
            return
        if self._member is not None and self._member is self._arguments:
            self._member.finish()  # a number at the end of the arguments is whole
        self._fail()

    def _structure(self, text: str, pos: int) -> int:
        c, expect = text[pos], self._expect
        if c in _SPACES:
            return pos + 1
        if c == "{" and expect == _START:
            self._expect = KEY_OR_END
        elif c == '"' and expect in (KEY, KEY_OR_END):
            self._member, self._role = JsonWriter(), "key"
            return pos  # the writer reads the key, quotes and all
        elif c == ":" and expect == COLON:
            self._role = self._value_role()
            self._member = JsonWriter(keep=bool(self._role))
            if self._role == "arguments":
                self._arguments = self._member
            self._expect = VALUE
        elif c == "," and expect == COMMA_OR_END:
            self._expect = KEY
        elif c == "}" and expect in (KEY_OR_END, COMMA_OR_END):
            self.state = DONE
            self._pump()
        else:
            self._fail()
            return pos
        return pos + 1

    def _value_role(self) -> str:
        role = ""
        if self._key == "name":
            role = "name"
        elif self._key in self._argument_keys:
            role = "arguments"
        if role in self._seen:
            return ""
        self._seen.add(role)
        return role

    def _member_done(self) -> None:
        member, role = self._member, self._role
        assert member is not None
        self._member, self._expect = None, COMMA_OR_END
        if member.state == FAILED:
            self._fail()
        elif role == "key":
            self._key, self._expect = json.loads(member.take()), COLON
        elif role == "name":
            name = json.loads(member.take()) if member.kind == '"' else None
            if not isinstance(name, str) or not name:
                self._fail()
            else:
                self._name = name
        elif role == "arguments" and member.kind == '"':
            whole = canonical_object(json.loads(member.take()))
            if whole is None:
                self._fail()
            else:  # a done writer holding the whole arguments, to be taken
                self._arguments = JsonWriter()
                self._arguments.feed(whole)

    def _pump(self) -> None:
        """Send what is decided: the start once name and arguments are, then fragments."""
        arguments = self._arguments
        if self.complete or arguments is None or arguments.kind != "{":
            return
        if not self.started:
            if self._name is None:
                return
            self._parser._start_call(self._name)
            self.started = True
        fragment = arguments.take()
        if fragment:
            self._parser._call_arguments(fragment)
        if arguments.state == DONE:
            self.complete = True

    def _fail(self) -> None:
        self.state = FAILED
        self._pump()
        if self.started and not self.complete:
            assert self._arguments is not None
            self._parser._call_arguments(self._arguments.closers())
            self.complete = True
