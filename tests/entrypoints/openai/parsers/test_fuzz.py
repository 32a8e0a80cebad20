"""Random soups of tag fragments, JSON and Python pieces: no parser raises, every random
split of a text streams exactly what `extract` returns for it, and every call's arguments
are a JSON object. Random arguments written as each format writes them stream back as
`json.dumps(arguments, ensure_ascii=False)`."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from hotswap.entrypoints.openai.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
)
from tests.entrypoints.openai.parsers.helpers import stream_reasoning, stream_tools
from tests.entrypoints.openai.parsers.test_partial_json import ALPHABET, random_text, random_value

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<think>", "</think>", "<th", "</",
    "<|python_tag|>", "<|python", "<function=f>", "</function>", "<parameter=x>",
    "</parameter>", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}',
    '{"name": ', '"}', "{", "}", "[", "]", ";", "[f(a='x')]", "f(b=2)", "'''", "'", '"',
    "\\", "\n", "  ", "text", "é", "<", ">", "(", ")", ",", ":", "1", "1e9", "tru", "null",
    '{"name": "f", "arguments": {"a": "', '"b": ', "\\u00e9", "\\ud83d", "[f(a=", "g(",
    "<function=f>", "<parameter=y>", "<tool_call>\n<function=g>\n<parameter=z>\n",
    '<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>',
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
]  # fmt: skip


def soup(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14)))


def random_pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 6))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_tool_parsers_on_random_soups(name: str) -> None:
    rng = random.Random(name)
    cls = TOOL_PARSERS[name]
    for _ in range(300):
        text = soup(rng)
        whole = cls(None).extract(text)
        expected = (
            whole.content or "",
            [(c.function.name, c.function.arguments) for c in whole.tool_calls],
        )
        for _, arguments in expected[1]:
            assert isinstance(json.loads(arguments), dict), text
        for _ in range(3):
            assert stream_tools(cls(None), random_pieces(rng, text)) == expected, text


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_reasoning_parsers_on_random_soups(name: str, enable_thinking: bool) -> None:
    rng = random.Random(name)
    cls = REASONING_PARSERS[name]
    for _ in range(300):
        text = soup(rng)
        reasoning, content = cls(enable_thinking=enable_thinking).extract(text)
        # nothing is lost but the tags a parser drops
        assert len(reasoning or "") + len(content or "") <= len(text)
        for _ in range(3):
            streamed = stream_reasoning(
                cls(enable_thinking=enable_thinking), random_pieces(rng, text)
            )
            assert streamed == (reasoning or "", content or ""), text


def random_arguments(rng: random.Random) -> dict[str, Any]:
    keys = ("city", "n", "opts", "q", "tags", "x_1")
    return {key: random_value(rng) for key in rng.sample(keys, rng.randrange(len(keys)))}


def hermes_call(rng: random.Random, arguments: dict[str, Any]) -> str:
    body = random_text(rng, {"name": "fn", "arguments": arguments})
    return f"Sure.<tool_call>\n{body}\n</tool_call>"


def llama_call(rng: random.Random, arguments: dict[str, Any]) -> str:
    return "<|python_tag|>" + random_text(rng, {"name": "fn", "parameters": arguments})


def pythonic_call(rng: random.Random, arguments: dict[str, Any]) -> str:
    written = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"[fn({written})]"


def qwen3_call(rng: random.Random, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    strings = {
        key: "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(8))) for key in arguments
    }
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in strings.items())
    return f"<tool_call>\n<function=fn>\n{body}</function>\n</tool_call>", strings


@pytest.mark.parametrize(
    ("cls", "write"),
    [
        (HermesToolParser, hermes_call),
        (Llama3JsonToolParser, llama_call),
        (PythonicToolParser, pythonic_call),
        (Qwen3CoderToolParser, qwen3_call),
    ],
)
def test_random_arguments_stream_back_as_json_dumps_writes_them(cls: type, write: Any) -> None:
    rng = random.Random(cls.__name__)
    for _ in range(150):
        arguments = random_arguments(rng)
        text = write(rng, arguments)
        if isinstance(text, tuple):
            text, arguments = text
        whole = cls(None).extract(text)
        expected = json.dumps(arguments, ensure_ascii=False)
        assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
            ("fn", expected)
        ], text
        for pieces in (list(text), random_pieces(rng, text), random_pieces(rng, text)):
            assert stream_tools(cls(None), pieces) == (whole.content or "", [("fn", expected)])
