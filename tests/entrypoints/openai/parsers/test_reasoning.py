"""Reasoning parsers `qwen3` and `deepseek_r1` (vLLM 0.32 semantics), alone and ahead of a
tool parser as the chat route chains them."""

from __future__ import annotations

import pytest

from hotswap.entrypoints.openai.parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    HermesToolParser,
    Qwen3CoderToolParser,
    Qwen3ReasoningParser,
    ToolParser,
)
from tests.entrypoints.openai.parsers.helpers import check_reasoning, splits, stream_tools

BOTH = (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        # the template opened <think> in the prompt
        ("Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
        # the model writes the tag itself: dropped
        ("<think>\nHmm, 2+2.\n</think>\n\n4", "\nHmm, 2+2.\n", "\n\n4"),
        ("</think>Just the answer.", None, "Just the answer."),
        ("Thinking until the end.", "Thinking until the end.", None),  # cut off: reasoning
        ("<think>Cut off at 1 < 2 and </thi", "Cut off at 1 < 2 and </thi", None),
        ("Done.</think>", "Done.", None),
        ("", None, None),
    ],
)
def test_split_at_the_end_tag(
    cls: type, text: str, reasoning: str | None, content: str | None
) -> None:
    assert check_reasoning(cls, text) == (reasoning, content)


def test_qwen3_specifics() -> None:
    # every <think> inside reasoning dropped; a stray </think> in the content dropped
    assert check_reasoning(Qwen3ReasoningParser, "<think>a<think>b</think>c</think>d") == (
        "ab",
        "cd",
    )
    # <tool_call> ends reasoning and starts the content, for the tool parser
    text = 'Need the weather.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert check_reasoning(Qwen3ReasoningParser, text) == (
        "Need the weather.\n",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    )
    # thinking off (chat_template_kwargs): all content, verbatim
    text = "<think>x</think>answer"
    assert check_reasoning(Qwen3ReasoningParser, text, enable_thinking=False) == (None, text)


def test_deepseek_r1_specifics() -> None:
    # only the first <think> dropped; text before it stays reasoning (as vLLM streams it);
    # after </think> everything is content, verbatim
    text = "pre<think>a<think>b</think>c</think><think>d"
    assert check_reasoning(DeepSeekR1ReasoningParser, text) == ("prea<think>b", "c</think><think>d")
    # R1 always thinks
    assert check_reasoning(DeepSeekR1ReasoningParser, "abc", enable_thinking=False) == ("abc", None)


def test_partial_tag_is_held_back_until_decided() -> None:
    parser = Qwen3ReasoningParser()
    delta = parser.feed("abc</thi")
    assert (delta.reasoning, delta.content) == ("abc", None)
    assert not parser.reasoning_ended
    delta = parser.feed("nk>x<tool")
    assert parser.reasoning_ended
    assert (delta.reasoning, delta.content) == (None, "x<tool")  # no tags in the content
    assert parser.feed("</th").content is None
    assert parser.finish().content == "</th"
    parser = Qwen3ReasoningParser()
    assert parser.feed("a <tool_ca").reasoning == "a "
    assert parser.feed("t>").reasoning == "<tool_cat>"


def test_is_reasoning_end_of_a_prompt() -> None:
    qwen, r1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nhi<|im_end|>\n"
    assert qwen.is_reasoning_end(history + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen.is_reasoning_end(history + "<|im_start|>assistant\n<think>\n")
    assert not qwen.is_reasoning_end(history + "<|im_start|>assistant\n")
    assert r1.is_reasoning_end("<｜Assistant｜><think>\n\n</think>")
    assert not r1.is_reasoning_end("<｜Assistant｜></think>x<think>\n")
    assert not r1.is_reasoning_end("<｜Assistant｜>")


def test_registered_under_vllm_names() -> None:
    assert REASONING_PARSERS["qwen3"] is Qwen3ReasoningParser
    assert REASONING_PARSERS["deepseek_r1"] is DeepSeekR1ReasoningParser


@pytest.mark.parametrize(
    ("tool_cls", "call"),
    [
        (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
        (
            Qwen3CoderToolParser,
            "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        ),  # fmt: skip
    ],
)
def test_reasoning_then_tools_chained(tool_cls: type[ToolParser], call: str) -> None:
    """Reasoning parser first, its content into the tool parser: every streamed split gives
    the non-streamed reasoning, content and calls."""
    text = "<think>\nI should call f.\n</think>\n\nCalling f.\n" + call
    reasoning, content = Qwen3ReasoningParser().extract(text)
    assert reasoning == "\nI should call f.\n"
    tools = tool_cls(None).extract(content or "")
    assert tools.content == "\n\nCalling f."
    assert [(c.function.name, c.function.arguments) for c in tools.tool_calls] == [
        ("f", '{"x": 1}' if tool_cls is HermesToolParser else '{"x": "1"}')
    ]
    for pieces in splits(text):
        thinker = Qwen3ReasoningParser()
        deltas = [*(thinker.feed(p) for p in pieces), thinker.finish()]
        streamed_reasoning = "".join(d.reasoning or "" for d in deltas)
        streamed = stream_tools(tool_cls(None), [d.content or "" for d in deltas])
        assert streamed_reasoning == reasoning
        assert streamed == (
            tools.content,
            [(c.function.name, c.function.arguments) for c in tools.tool_calls],
        )
