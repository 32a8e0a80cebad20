"""`pythonic` (Llama 3.2, Llama 4, ToolACE and others): the output is a Python list of calls

    [get_weather(city='San Francisco', days=3), get_time(tz="PST")]

As vLLM's PythonicToolParser: the output is calls only when it starts with `[` (here
leading whitespace is allowed too); the list is read with `ast` (nothing is evaluated) and
must hold only calls of a name or a dotted name (`a.b.c`), with keyword arguments whose
values are literals: strings, numbers (a sign too), None/True/False or JSON's
null/true/false, f-strings without placeholders, and dicts with constant keys, lists,
tuples and sets (as arrays) of those. The arguments are serialized with
`json.dumps(..., ensure_ascii=False)`. The list is held until its `]` and then emitted whole;
if it is not valid, or never closes, the whole output is content. Text after the list is
dropped (vLLM's streaming drops it too).
"""

from __future__ import annotations

import ast
import warnings
from typing import Any

from hotswap.entrypoints.openai.parsers.base import ToolParser, dump_arguments

OPEN, BROKEN = -1, -2
_JSON_NAMES = {"null": None, "true": True, "false": False}


class PythonListScanner:
    """Finds where the bracketed Python expression opening at offset 0 of a growing text
    closes, scanning every character once: quotes ('', "", triple), escapes and nesting."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.quote = ""  # the open string's delimiter
        self.escaped = False

    def end(self, text: str, eof: bool) -> int:
        """The offset just past the closing bracket; OPEN while undecided; BROKEN when a
        one-line string crosses a line end (not Python)."""
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
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
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


def parse_calls(source: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a list of calls, or None if `source` is not one."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in strings
            tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for call in tree.body.elts:
            if not isinstance(call, ast.Call) or call.args:
                return None  # positional arguments have no parameter names
            if any(keyword.arg is None for keyword in call.keywords):
                return None  # **kwargs
            arguments = dump_arguments({k.arg: literal(k.value) for k in call.keywords})
            if arguments is None:
                return None
            calls.append((dotted_name(call.func), arguments))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"  # start | list | text
        self._raw = ""  # leading whitespace, content again if the list is not calls
        self._head: list[str] = []  # the list's scanned text before `_buf`
        self._scanner = PythonListScanner()

    def _advance(self, eof: bool) -> None:
        if self._mode == "start":
            rest = self._buf.lstrip()
            if not rest and not eof:
                return
            if rest.startswith("["):
                self._raw, self._buf = self._buf[: len(self._buf) - len(rest)], rest
                self._mode = "list"
            else:
                self._mode = "text"
        if self._mode == "list":
            end = self._scanner.end(self._buf, eof)
            if end == OPEN and not eof:  # scanned text out of the growing buffer
                self._head.append(self._buf[: self._scanner.pos])
                self._buf, self._scanner.pos = self._buf[self._scanner.pos :], 0
                return
            self._buf = "".join(self._head) + self._buf
            end += sum(map(len, self._head)) if end > 0 else 0
            self._head = []
            calls = parse_calls(self._buf[:end]) if end > 0 else None
            for name, arguments in calls or ():
                self._call(name, arguments)
            if calls:
                self._buf = self._buf[end:]  # after the calls: dropped
            else:
                self._buf = self._raw + self._buf
            self._raw, self._mode = "", "text"
        self._text(self._buf)
        self._buf = ""
