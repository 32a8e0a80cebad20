"""Random soups of tag fragments, JSON and Python pieces: no parser raises, and every random
split of a text streams exactly what `extract` returns for it."""

from __future__ import annotations

import random

import pytest

from hotswap.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS
from tests.entrypoints.openai.parsers.helpers import stream_reasoning, stream_tools

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<think>", "</think>", "<th", "</",
    "<|python_tag|>", "<|python", "<function=f>", "</function>", "<parameter=x>",
    "</parameter>", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}',
    '{"name": ', '"}', "{", "}", "[", "]", ";", "[f(a='x')]", "f(b=2)", "'''", "'", '"',
    "\\", "\n", "  ", "text", "é", "<", ">", "(", ")", ",",
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
