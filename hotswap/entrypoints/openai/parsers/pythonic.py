"""`pythonic` (Llama 3.2, Llama 4, ToolACE and others): the output is a Python list of calls

    [get_weather(city='San Francisco', days=3), get_time(tz="PST")]

As vLLM's PythonicToolParser: the output is calls only when it starts with `[` (here
leading whitespace is allowed too); the list is read with `ast` (nothing is evaluated) and
must hold only calls of a name or a dotted name (`a.b.c`), with keyword arguments whose
values are literals: strings, numbers (a sign too), None/True/False or JSON's
null/true/false, f-strings without placeholders, and dicts with constant keys, lists,
tuples and sets (as arrays) of those. The arguments are serialized with
`json.dumps(..., ensure_ascii=False)`. Text after the list is dropped (vLLM's streaming
drops it too).

Streaming, as vLLM streams these calls but one argument at a time: a keyword argument is
read with `ast` once the `,` or `)` after it arrives (a Python value is only certain whole:
`'a' 'b'` is one string, `1` may become `1e3`), and the call starts (name sent) with its
first argument, or at its `)` when it has none; each argument is sent as `{"key": value`
or `, "key": value`, and `}` at the `)`. If the list breaks before a call started (not a
call, not a literal, a positional argument, a one-line string across a line end, cut off)
the whole output is content, at once. After one started, the call that was open stays as
sent, closed with `}`, and the rest of the output is dropped (`[f(x=1), 3]` is f; a
repeated keyword, which Python rejects, breaks the list there).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from hotswap.entrypoints.openai.parsers.base import ToolParser

OPEN, BROKEN = -1, -2
_NOT_NAME = re.compile(r"[^\w.\s]")  # the first character that cannot be in a dotted name
_JSON_NAMES = {"null": None, "true": True, "false": False}


class ArgumentScanner:
    """Finds where one call argument of a growing text ends (at a `,` or `)` outside
    brackets and strings), scanning every character once: quotes ('', "", triple), escapes
    and nesting."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.quote = ""  # the open string's delimiter
        self.escaped = False

    def end(self, text: str, eof: bool) -> int:
        """The offset of the `,` or `)` that ends the argument; OPEN while undecided;
        BROKEN when a one-line string crosses a line end or a `]` or `}` closes nothing."""
        i = self.pos
        while i < len(text):
            c = text[i]
            if self.quote or c in "'\"":
                step = self._string_step(text, i, eof)
                if step <= 0:
                    if step == 0:  # wait for more text to tell ' from '''
                        break
                    return BROKEN
                i += step
                continue
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                if not self.depth:
                    return i if c == ")" else BROKEN
                self.depth -= 1
            elif c == "," and not self.depth:
                return i
            i += 1
        self.pos = i
        return OPEN

    def _string_step(self, text: str, i: int, eof: bool) -> int:
        """How many characters at `i` are consumed inside or at the edge of a string (0:
        undecided until more text comes, -1: broken)."""
        c = text[i]
        if not self.quote:
            triple = c * 3
            if text.startswith(triple, i):
                self.quote = triple
                return 3
            if not eof and len(text) - i < 3 and triple.startswith(text[i:]):
                return 0
            self.quote = c
            return 1
        if self.escaped:
            self.escaped = False
        elif c == "\\":
            self.escaped = True
        elif len(self.quote) == 1:
            if c == "\n":
                return -1
            if c == self.quote:
                self.quote = ""
        elif text.startswith(self.quote, i):
            self.quote = ""
            return 3
        elif not eof and len(text) - i < 3 and self.quote.startswith(text[i:]):
            return 0
        return 1


def literal(node: ast.expr) -> Any:
    """The JSON value of a literal node (ValueError for anything else)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal(e) for e in node.elts]
    elif isinstance(node, ast.JoinedStr):
        if all(isinstance(part, ast.Constant) for part in node.values):
            return "".join(str(part.value) for part in node.values)  # type: ignore[attr-defined]
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = literal(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise ValueError(f"not a literal: {ast.dump(node)}")


def dotted_name(node: ast.expr) -> str:
    """`a.b.c` of a call's target (ValueError unless names and attributes only)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise ValueError("a call target must be a (dotted) name")
    parts.append(node.id)
    return ".".join(reversed(parts))


def call_name(target: str) -> str | None:
    """The dotted name of a call's target (the text before its `(`), or None."""
    try:
        return dotted_name(ast.parse(f"({target})", mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def keyword_argument(text: str) -> tuple[str, str] | None:
    """(name, value as JSON) of one keyword argument's text, `city='SF'`; None unless it is
    one with a literal value that has a JSON form."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in strings
            call = ast.parse(f"_({text}\n)", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1:
            return None  # positional: no parameter name
        keyword = call.keywords[0]
        if keyword.arg is None:  # **kwargs
            return None
        value = json.dumps(literal(keyword.value), ensure_ascii=False, allow_nan=False)
        return keyword.arg, value
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"  # start | target | arguments | after | done | text
        self._raw: list[str] = []  # consumed text, content again if no call starts
        self._piece: list[str] = []  # the call target or argument being read, before `_buf`
        self._scanner = ArgumentScanner()
        self._name = ""  # the open call's
        self._keys: list[str] = []  # its arguments' names, in order (sent ones)

    def _advance(self, eof: bool) -> None:
        if self._mode == "start" and not self._start(eof):
            return
        steps = {"target": self._target, "arguments": self._arguments, "after": self._after}
        while self._mode in steps:
            if not (self._buf and steps[self._mode](eof)):
                if not eof:
                    return
                self._broke()  # the list never closed
        if self._mode == "text":
            self._text(self._buf)
        self._buf = ""  # "done": text after the list is dropped

    def _consume(self, n: int) -> None:
        if not self._n_calls:  # after the first call nothing becomes content again
            self._raw.append(self._buf[:n])
        self._buf = self._buf[n:]

    def _start(self, eof: bool) -> bool:
        rest = self._buf.lstrip()
        if not rest and not eof:
            return False
        if rest.startswith("["):
            self._consume(len(self._buf) - len(rest) + 1)
            self._mode = "target"
        else:
            self._mode = "text"
        return True

    def _target(self, eof: bool) -> bool:
        """A call's dotted name up to its `(`, or the list's `]` after a trailing comma."""
        match = _NOT_NAME.search(self._buf)
        if match is None:
            self._piece.append(self._buf)
            self._consume(len(self._buf))
            return False
        at = match.start()
        target, mark = "".join(self._piece) + self._buf[:at], self._buf[at]
        self._piece = []
        self._consume(at + 1)
        name = call_name(target) if mark == "(" else None
        if name:
            self._name, self._keys, self._scanner = name, [], ArgumentScanner()
            self._mode = "arguments"
        elif mark == "]" and not target.strip() and self._n_calls:
            self._mode = "done"
        else:
            self._broke()
        return True

    def _arguments(self, eof: bool) -> bool:
        """One keyword argument, up to the `,` or `)` after it."""
        end = self._scanner.end(self._buf, eof)
        if end == OPEN:  # scanned text out of the growing buffer
            self._piece.append(self._buf[: self._scanner.pos])
            self._consume(self._scanner.pos)
            self._scanner.pos = 0
            return False
        if end == BROKEN:
            self._broke()
            return True
        text, mark = "".join(self._piece) + self._buf[:end], self._buf[end]
        self._piece, self._scanner = [], ArgumentScanner()
        self._consume(end + 1)
        if not (self._argument(text) if text.strip() else mark == ")"):
            self._broke()
        elif mark == ")":
            if self._keys:
                self._call_arguments("}")
            else:
                self._start_call(self._name)
                self._call_arguments("{}")
            self._keys, self._mode = [], "after"
        return True

    def _argument(self, text: str) -> bool:
        """Send one keyword argument (the call starts at its first); False if it is not one."""
        parsed = keyword_argument(text)
        if parsed is None or parsed[0] in self._keys:
            return False
        key, value = parsed
        item = f"{json.dumps(key, ensure_ascii=False)}: {value}"
        if self._keys:
            self._call_arguments(", " + item)
        else:
            self._start_call(self._name)
            self._call_arguments("{" + item)
        self._keys.append(key)
        return True

    def _after(self, eof: bool) -> bool:
        """After a call: `,` and the next call, or the list's `]`."""
        rest = self._buf.lstrip()
        self._consume(len(self._buf) - len(rest))
        if not rest:
            return False
        self._consume(1)
        if rest[0] == ",":
            self._mode = "target"
        elif rest[0] == "]":
            self._mode = "done"
        else:
            self._broke()
        return True

    def _broke(self) -> None:
        """Not a list of calls: all content if no call started, else the open call (if
        any) is closed as sent and the rest dropped."""
        if not self._n_calls:
            self._buf = "".join(self._raw) + self._buf
            self._raw, self._piece, self._mode = [], [], "text"
            return
        if self._mode == "arguments" and self._keys:
            self._call_arguments("}")
        self._keys, self._mode = [], "done"
