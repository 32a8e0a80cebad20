"""Partial JSON for the streaming tool parsers: one value read as its text arrives, and
written back as far as it is decided.

`JsonWriter` reads one strict JSON value from text given in pieces and writes it in
`json.dumps(value, ensure_ascii=False)` form: ", " and ": " separators, no other
whitespace, strings with only `"`, `\\` and control characters escaped (escapes in the
input are decoded, a `\\uD83D\\uDE00` pair into one character), numbers as Python's `json`
reads and writes them (`1E2` -> `100.0`, `-0` -> `0`, big integers exact).

Invariants:
- `take()` returns only text that no later input can change: a string's characters as
  they are decoded (an escape once whole, a high surrogate escape once it is known whether
  a low one follows), a number once a character after it ends it, `true`/`false`/`null`
  once spelled out, a key (and the ", " before it) together with the start of its value,
  a bracket when read. Everything taken, concatenated, is a prefix of the final text.
- What is written, and where reading stops, depend only on the text, never on how it was
  split into pieces.
- On a complete value without duplicate keys the text written equals
  `json.dumps(json.loads(text), ensure_ascii=False)`. Duplicate keys are written as they
  come, in order (a JSON reader keeps the last, as `json.loads` does): a key's earlier
  value was already taken when the later one arrives.
- The grammar is `json.loads`'s strict one less NaN and Infinity (no valid JSON for them)
  and less integers Python will not read (over 4300 digits): anything else fails.
- `closers()`, whatever the state, is what closes the text written so far into valid JSON
  (a string's quote, then the open arrays' and objects' brackets).
"""

from __future__ import annotations

import json
import math
import re

OPEN, DONE, FAILED = "open", "done", "failed"
WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_SPACE_RUN = re.compile(r"[ \t\n\r]+")
_HEX = frozenset("0123456789abcdefABCDEF")
# What may come next.
VALUE, VALUE_OR_END, KEY, KEY_OR_END, COLON, COMMA_OR_END = range(6)


def number_text(token: str) -> str | None:
    """A JSON number as `json.dumps(json.loads(token))` writes it; None if `token` is not
    one or has no JSON form (it overflows to inf, or has too many digits to read)."""
    match = _NUMBER.fullmatch(token)
    if match is None:
        return None
    try:
        if match.group(1) or match.group(2):
            value = float(token)
            return repr(value) if math.isfinite(value) else None
        return repr(int(token))
    except ValueError:
        return None


def string_text(decoded: str) -> str:
    """The inside of `json.dumps(decoded, ensure_ascii=False)` (its quotes off). Characters
    are escaped one by one, so the pieces of a string concatenate to the whole."""
    return json.dumps(decoded, ensure_ascii=False)[1:-1]


class JsonWriter:
    """One JSON value, read as it arrives and written back as far as it is decided."""

    def __init__(self, keep: bool = True) -> None:
        self.state = OPEN
        self.kind = ""  # the value's first character once it began: { [ " - digit t f n
        self._keep = keep  # False: validate only, write nothing
        self._stack: list[bool] = []  # the open containers, True for an object
        self._expect = VALUE
        self._out: list[str] = []  # written, not yet taken
        self._pending = ""  # ", " and a key, written with the start of their value
        self._token = ""  # the number or literal being read
        self._string: list[str] | None = None  # the open string's text (escaped), not written
        self._is_key = False  # the open string is a key
        self._escape: str | None = None  # after a backslash: "", or "u" and hex digits
        self._high = ""  # a high surrogate escape waiting to see if a low one follows

    def feed(self, text: str, pos: int = 0) -> int:
        """Read `text[pos:]`; the offset where reading stopped: the end of the text, just
        past the value (a number ends at the character after it, which is left unread), or
        at the character that broke it (then `state` is FAILED)."""
        end = len(text)
        while pos < end and self.state == OPEN:
            if self._string is not None:
                pos = self._string_part(text, pos)
            elif self._token:
                pos = self._token_part(text, pos)
            else:
                pos = self._structure(text, pos)
        return pos

    def finish(self) -> None:
        """End of the input: a number at the end is whole; a value still open fails."""
        if self.state != OPEN:
            return
        if self._token and self._token[0] not in _LITERALS:
            self._end_number()
        if self.state == OPEN:
            self._fail()

    def take(self) -> str:
        """The text written since the last take."""
        if self._string and not self._is_key:
            self._write("".join(self._string))
            self._string.clear()
        text = "".join(self._out)
        self._out.clear()
        return text

    def closers(self) -> str:
        open_string = self._string is not None and not self._is_key
        brackets = "".join("}" if is_object else "]" for is_object in reversed(self._stack))
        return ('"' if open_string else "") + brackets

    def _write(self, text: str) -> None:
        if self._keep:
            self._out.append(text)

    def _fail(self) -> None:
        self.state = FAILED
        if self._string is not None:
            self._flush_high()  # decided: nothing follows it

    def _value_done(self) -> None:
        if self._stack:
            self._expect = COMMA_OR_END
        else:
            self.state = DONE

    def _structure(self, text: str, pos: int) -> int:
        space = _SPACE_RUN.match(text, pos)
        if space:
            return space.end()
        c, expect = text[pos], self._expect
        if expect in (VALUE, VALUE_OR_END) and self._start_value(c):
            pass
        elif c == '"' and expect in (KEY, KEY_OR_END):
            self._string, self._is_key = [], True
        elif c == ":" and expect == COLON:
            self._expect = VALUE
        elif c == "," and expect == COMMA_OR_END:
            self._pending = ", "
            self._expect = KEY if self._stack[-1] else VALUE
        elif (
            c in "}]"
            and expect in (KEY_OR_END, VALUE_OR_END, COMMA_OR_END)
            and (self._stack[-1] == (c == "}"))
        ):
            self._write(c)
            self._stack.pop()
            self._value_done()
        else:
            self._fail()
            return pos
        return pos + 1

    def _start_value(self, c: str) -> bool:
        """Begin the value that `c` opens; False if `c` opens none."""
        if c == '"':
            self._string, self._is_key = [], False
            self._write(self._pending + c)
            self._pending = ""
        elif c in "{[":
            self._write(self._pending + c)
            self._pending = ""
            self._stack.append(c == "{")
            self._expect = KEY_OR_END if c == "{" else VALUE_OR_END
        elif c in "-0123456789" or c in _LITERALS:
            self._token = c  # written, with the pending key, when it ends
        else:
            return False
        self.kind = self.kind or c
        return True

    def _token_part(self, text: str, pos: int) -> int:
        word = _LITERALS.get(self._token[0])
        if word is None:  # a number: it ends at the first character that is not its
            end = pos
            while end < len(text) and text[end] in _NUMBER_CHARS:
                end += 1
            self._token += text[pos:end]
            if end < len(text):
                self._end_number()
            return end
        if text[pos] != word[len(self._token)]:
            self._fail()
            return pos
        self._token += text[pos]
        if self._token == word:
            self._write(self._pending + word)
            self._pending, self._token = "", ""
            self._value_done()
        return pos + 1

    def _end_number(self) -> None:
        written = number_text(self._token)
        if written is None:
            self._fail()
            return
        self._write(self._pending + written)
        self._pending, self._token = "", ""
        self._value_done()

    def _string_part(self, text: str, pos: int) -> int:
        if self._escape is not None:
            self._escape_char(text[pos])
            return pos + 1
        run = _STRING_RUN.match(text, pos)
        if run:  # nothing in it to escape: written as it is
            self._chars(run.group())
            return run.end()
        c = text[pos]
        if c == "\\":
            self._escape = ""
        elif c == '"':
            self._end_string()
        else:  # a raw control character: not strict JSON
            self._fail()
            return pos
        return pos + 1

    def _escape_char(self, c: str) -> None:
        """One character of an escape (after its backslash)."""
        escape = self._escape or ""
        if not escape and c in _ESCAPES:
            self._escape = None
            self._chars(string_text(_ESCAPES[c]))
        elif not escape and c == "u" or escape and c in _HEX:
            self._escape = escape + c
            if len(self._escape) == 5:
                self._escape = None
                self._code_point(int(escape[1:] + c, 16))
        else:
            self._fail()

    def _code_point(self, code: int) -> None:
        """A decoded `\\uXXXX`; surrogate pairs join as `json.loads` joins them."""
        if 0xDC00 <= code <= 0xDFFF and self._high:
            high, self._high = ord(self._high), ""
            self._chars(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))  # no escape
        elif 0xD800 <= code <= 0xDBFF:
            self._flush_high()
            self._high = chr(code)
        else:
            self._chars(string_text(chr(code)))

    def _flush_high(self) -> None:
        if self._high and self._string is not None:
            high, self._high = self._high, ""
            self._chars(high)

    def _chars(self, escaped: str) -> None:
        """Decoded characters, as `string_text` writes them."""
        self._flush_high()
        if self._string is not None and (self._keep or self._is_key):
            self._string.append(escaped)

    def _end_string(self) -> None:
        self._flush_high()
        escaped = "".join(self._string or ())
        self._string = None
        if self._is_key:
            self._pending += f'"{escaped}": '
            self._expect = COLON
            return
        self._write(escaped + '"')
        self._value_done()


def canonical_object(text: str) -> str | None:
    """A whole JSON object (whitespace around it allowed) written as `JsonWriter` writes
    it; None if `text` is not exactly one."""
    writer = JsonWriter()
    end = writer.feed(text)
    writer.finish()
    if writer.state != DONE or writer.kind != "{" or text[end:].strip(WHITESPACE):
        return None
    return writer.take()
