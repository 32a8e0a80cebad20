"""`qwen3_coder` (Qwen3-Coder, Qwen3.5; vLLM's alias `qwen3_xml`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    San Francisco
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

As vLLM 0.32's Qwen3 parser engine (`vllm/parser/qwen3.py`, `parser_engine.py`): a value is
the text between `<parameter=NAME>` and `</parameter>` (or the next `<parameter=`, or the
end of the function) less one leading and one trailing newline; every value is a string
unless the request's tool schema types that parameter, in which case it is coerced as
vLLM's `coerce_to_schema_type` does (null > integer > number > boolean > object > array >
string, the first that fits; none fitting, JSON if it parses, else the string). Parameters
the schema does not name, and every parameter of a tool the request does not list, stay
strings. A region may hold several functions (a stray `<tool_call>` between them too); text
in a function outside its parameters is ignored; a region open at the end of the output
still counts when its last function is closed.

Streaming, as vLLM's engine: a function's call starts (name sent) once its first parameter
is whole (its end tag, the next `<parameter=` or `</function>` arrived) or the function
closes; each parameter is then sent whole, converted, as `{"key": value` or
`, "key": value`, and `}` when the function closes, so the fragments build up the
arguments `{"a": 1, "b": "x"}`. A parameter named twice is sent twice (the arguments then
hold the key twice, in order; a JSON reader keeps the last, as vLLM's dict does). Malformed
before a call started (no name, text between functions, cut off before a parameter
closed), the region is text; after (cut off, or text after the function), the call stays
as sent and is closed with `}` (the unfinished parameter dropped), and the rest of the
region is ignored. (vLLM also streams a string-typed value before its end tag; here a value
is only sent once whole.)
"""

from __future__ import annotations

import json
import math
from typing import Any

from hotswap.entrypoints.openai.parsers.base import is_json_finite, tool_properties
from hotswap.entrypoints.openai.parsers.tagged import TaggedToolParser

_FUNCTION_START, _FUNCTION_END = "<function=", "</function>"
_PARAMETER_START, _PARAMETER_END = "<parameter=", "</parameter>"
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES = (
    (bool, "boolean"),  # before int: a bool is an int
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows: `type` (a name or a list), the types of
    its `enum` values, and those of its anyOf/oneOf/allOf branches; {"string"} if none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            kind = "null" if value is None else None
            kind = kind or next((n for t, n in _ENUM_TYPES if isinstance(value, t)), None)
            if kind:
                types.add(kind)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                types |= schema_types(branch)
    return types or {"string"}


def _as_type(value: str, kind: str) -> tuple[bool, Any]:
    """(fits, converted) for one JSON type, as vLLM's coerce_to_schema_type tries it."""
    if kind == "null":
        return value.lower() == "null", None
    if kind == "string":
        return True, value
    if kind == "integer":
        try:
            return True, int(value)
        except ValueError:
            return False, None
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return False, None
        if not math.isfinite(number):
            return False, None
        return True, (int(number) if number == int(number) else number)
    if kind == "boolean":
        word = value.strip().lower()
        if word in ("true", "1", "false", "0"):
            return True, word in ("true", "1")
        return False, None
    try:  # object, array
        parsed = json.loads(value)
    except ValueError:
        return False, None
    return is_json_finite(parsed), parsed


def coerce(value: str, types: set[str]) -> Any:
    """`value` converted to the first of `types` (by vLLM's priority) it fits."""
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _PRIORITY:
        if kind in wanted:
            fits, converted = _as_type(value, kind)
            if fits:
                return converted
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if is_json_finite(parsed) else value


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(TaggedToolParser):
    """A region's body is read as it arrives; `_state` says where in it the reader is:
    between functions, in a function's name, in its body outside parameters, in a
    parameter's name or in its value, or "dead" once it broke (the rest is ignored)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._region_open()

    def _region_open(self) -> None:
        self._state = "between"
        self._rest = ""  # body received, not yet decided
        self._scanned = 0  # no tag the state looks for starts before this offset of `_rest`
        self._name = ""  # the open function's
        self._properties: dict[str, Any] = {}  # its parameters' schemas
        self._key = ""  # the open parameter's name
        self._value: list[str] = []  # its value's text before `_rest`
        self._sent = False  # the open function's call started

    def _region_feed(self, body: str) -> None:
        self._rest += body
        steps = {
            "between": self._between,
            "name": self._function_name,
            "function": self._function_body,
            "key": self._parameter_name,
            "value": self._parameter_value,
        }
        while self._rest and self._state in steps and steps[self._state]():
            pass

    def _region_close(self, closed: bool) -> None:
        """Nothing more comes: done between functions, else the open function broke."""
        if self._state != "between" or self._rest.strip():
            self._broke()

    def _broke(self) -> None:
        """Malformed: a call that started stays as sent, closed; the rest is ignored."""
        if self._sent:
            self._call_arguments("}")
        self._sent, self._state, self._rest = False, "dead", ""

    def _find(self, *tags: str) -> tuple[int, str] | None:
        """The first of `tags` in `_rest` (offset, tag), scanning each character once."""
        hits = [(i, tag) for tag in tags if (i := self._rest.find(tag, self._scanned)) >= 0]
        if hits:
            self._scanned = 0
            return min(hits)
        self._scanned = max(0, len(self._rest) - max(map(len, tags)) + 1)
        return None

    def _between(self) -> bool:
        """Whitespace and stray start tags until `<function=`."""
        rest = self._rest.lstrip()
        for tag, state in ((self.start_tag, "between"), (_FUNCTION_START, "name")):
            if rest.startswith(tag):
                self._rest, self._state = rest[len(tag) :], state
                return True
        self._rest = rest
        if not (self.start_tag.startswith(rest) or _FUNCTION_START.startswith(rest)):
            self._broke()
        return False

    def _function_name(self) -> bool:
        end = self._rest.find(">")
        if end < 0:
            return False
        name, self._rest = self._rest[:end].strip(), self._rest[end + 1 :]
        if not name:
            self._broke()
            return False
        self._name, self._properties = name, tool_properties(self.tools, name)
        self._state = "function"
        return True

    def _function_body(self) -> bool:
        """Outside parameters (text there is ignored) until `<parameter=` or the end."""
        found = self._find(_PARAMETER_START, _FUNCTION_END)
        if found is None:  # what was scanned is ignored text
            self._rest, self._scanned = self._rest[self._scanned :], 0
            return False
        at, tag = found
        self._rest = self._rest[at + len(tag) :]
        if tag == _FUNCTION_END:
            self._end_function()
        else:
            self._state = "key"
        return True

    def _parameter_name(self) -> bool:
        end = self._rest.find(">")
        if end < 0:
            return False
        if self._rest.find(_FUNCTION_END, 0, end + 1) >= 0:  # `<parameter=...</function>`
            self._rest = self._rest[end + 1 :]
            self._end_function()
            return True
        self._key, self._rest = self._rest[:end].strip(), self._rest[end + 1 :]
        self._state = "value"
        return True

    def _parameter_value(self) -> bool:
        """The value ends at `</parameter>`, the next `<parameter=` or the function's end."""
        found = self._find(_PARAMETER_END, _PARAMETER_START, _FUNCTION_END)
        if found is None:  # what was scanned is value text
            self._value.append(self._rest[: self._scanned])
            self._rest, self._scanned = self._rest[self._scanned :], 0
            return False
        at, tag = found
        self._parameter(self._key, "".join(self._value) + self._rest[:at])
        self._value = []
        self._rest = self._rest[at + len(tag) :]
        if tag == _FUNCTION_END:
            self._end_function()
        else:
            self._state = "key" if tag == _PARAMETER_START else "function"
        return True

    def _parameter(self, key: str, raw: str) -> None:
        """Send one whole parameter, `"key": value`, starting the call at the first."""
        text = f"{json.dumps(key, ensure_ascii=False)}: {self._value_json(key, raw)}"
        if self._sent:
            self._call_arguments(", " + text)
        else:
            self._start_call(self._name)
            self._call_arguments("{" + text)
            self._sent = True

    def _value_json(self, key: str, raw: str) -> str:
        value = _trim_newlines(raw)
        schema = self._properties.get(key)
        if isinstance(schema, dict):
            try:
                return json.dumps(coerce(value, schema_types(schema)), ensure_ascii=False)
            except (RecursionError, ValueError, TypeError):  # nested too deep: the string
                pass
        return json.dumps(value, ensure_ascii=False)

    def _end_function(self) -> None:
        if self._sent:
            self._call_arguments("}")
        else:
            self._start_call(self._name)
            self._call_arguments("{}")
        self._sent, self._state = False, "between"
