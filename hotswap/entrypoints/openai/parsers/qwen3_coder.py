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
strings. A region may hold several functions; a region open at the end of the output still
counts when its last function is closed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hotswap.entrypoints.openai.parsers.base import dump_arguments, is_json_finite, tool_properties
from hotswap.entrypoints.openai.parsers.tagged import TaggedToolParser

_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
    re.DOTALL,
)
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
    def _parse_region(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        calls: list[tuple[str, str]] = []
        pos = 0
        for match in _FUNCTION.finditer(body):
            # Only whitespace between functions (a repeated start tag too: a model that
            # forgets `</tool_call>` between two calls, which vLLM 0.32 accepts as well).
            if body[pos : match.start()].replace(self.start_tag, "").strip():
                return None
            name = match.group(1).strip()
            arguments = self._arguments(name, match.group(2))
            if not name or arguments is None:
                return None
            calls.append((name, arguments))
            pos = match.end()
        if body[pos:].strip():
            return None
        return calls or None

    def _arguments(self, name: str, function_body: str) -> str | None:
        properties = tool_properties(self.tools, name)
        arguments: dict[str, Any] = {}
        for match in _PARAMETER.finditer(function_body):
            key, value = match.group(1).strip(), _trim_newlines(match.group(2))
            schema = properties.get(key)
            if isinstance(schema, dict):
                value = coerce(value, schema_types(schema))
            arguments[key] = value
        return dump_arguments(arguments)
