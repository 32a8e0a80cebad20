"""Reasoning parsers: `<think>`...`</think>` is reasoning, the rest content (vLLM 0.32's
`--reasoning-parser` names `qwen3` and `deepseek_r1`).

Both start inside reasoning (the chat templates open `<think>` in the prompt; a model that
writes the tag itself gets it dropped), so an output without `</think>` is all reasoning:
it was cut off while thinking. The text after the first `</think>` is content. As every
parser in this package, decisions depend only on the text so far (a partial tag is held
back until the next delta decides it), so streaming emits exactly what `extract` returns.
Empty reasoning or content is None (vLLM's deepseek_r1 returns "" for an empty reasoning).

- `deepseek_r1` (vLLM's DeepSeekR1ReasoningParser on BaseThinkingReasoningParser): only
  the first `<think>` before `</think>` is dropped; text before it stays reasoning, as
  vLLM's streaming has it (its non-streaming path drops that text). The content is
  verbatim. `enable_thinking` does not apply (R1 always thinks).
- `qwen3` (vLLM 0.32's Qwen3 parser engine, `vllm/parser/qwen3.py`): every `<think>` inside
  reasoning is dropped; `<tool_call>` inside reasoning ends it implicitly and starts the
  content (the tag included, for the tool parser); a stray `</think>` in the content is
  dropped. With `enable_thinking=False` (the request's chat_template_kwargs) the whole
  output is content, verbatim, as vLLM's `extract_reasoning` returns it.
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.base import ParsedDelta, partial_overlap

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


class ReasoningParser:
    """Splits an output into reasoning and content; one instance per output stream."""

    start_tag = THINK_START
    end_tag = THINK_END
    turn_boundaries: tuple[str, ...] = ()  # prompt markers of a new turn (is_reasoning_end)
    implicit_ends: tuple[str, ...] = ()  # tags that end reasoning and begin the content

    def __init__(self, *, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking
        self._state = "reasoning" if self._thinks() else "verbatim"
        self._buf = ""
        self._start_dropped = False
        self._out: dict[str, list[str]] = {"reasoning": [], "content": []}

    @property
    def reasoning_ended(self) -> bool:
        """Whether this stream is past its reasoning (what follows is content)."""
        return self._state != "reasoning"

    def _thinks(self) -> bool:
        return self.enable_thinking

    def _markers(self) -> tuple[str, ...]:
        """The tags that mean something in the current state."""
        raise NotImplementedError

    def _on_marker(self, marker: str) -> str:
        """Apply `marker` (just consumed from the buffer); returns what of it is text of
        the state it leads to ("" to drop it)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output (this parser's streaming state untouched)."""
        fresh = type(self)(enable_thinking=self.enable_thinking)
        deltas = (fresh.feed(text), fresh.finish())
        reasoning = "".join(d.reasoning or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        return reasoning or None, content or None

    def feed(self, delta_text: str) -> ParsedDelta:
        self._buf += delta_text
        self._advance(eof=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._advance(eof=True)
        return self._take()

    def is_reasoning_end(self, text: str) -> bool:
        """Whether `text` (a rendered prompt) already closed reasoning in its last turn, as
        vLLM's `is_reasoning_end` on the prompt: its last think marker after the last turn
        boundary is an end (`</think>`, or an implicit end). Then the output is all content
        (Qwen3.5's template writes `<think>\\n\\n</think>\\n\\n` when thinking is off)."""
        turn = max((text.rfind(b) + len(b) for b in self.turn_boundaries if b in text), default=0)
        tail = text[turn:]
        end = max(tail.rfind(m) for m in (self.end_tag, *self.implicit_ends))
        return end >= 0 and end > tail.rfind(self.start_tag)

    def _advance(self, eof: bool) -> None:
        while self._buf:
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
            if not hits:
                keep = max((partial_overlap(self._buf, m) for m in markers), default=0)
                keep = 0 if eof else keep
                self._emit(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return
            i, marker = min(hits)
            self._emit(self._buf[:i])
            self._buf = self._buf[i + len(marker) :]
            self._emit(self._on_marker(marker))

    def _emit(self, text: str) -> None:
        if text:
            self._out["reasoning" if self._state == "reasoning" else "content"].append(text)

    def _take(self) -> ParsedDelta:
        delta = ParsedDelta(
            reasoning="".join(self._out["reasoning"]) or None,
            content="".join(self._out["content"]) or None,
        )
        self._out = {"reasoning": [], "content": []}
        return delta


class DeepSeekR1ReasoningParser(ReasoningParser):
    def _thinks(self) -> bool:
        return True

    def _markers(self) -> tuple[str, ...]:
        if self._state != "reasoning":
            return ()
        return (self.end_tag,) if self._start_dropped else (self.start_tag, self.end_tag)

    def _on_marker(self, marker: str) -> str:
        if marker == self.start_tag:
            self._start_dropped = True
        else:
            self._state = "content"
        return ""


class Qwen3ReasoningParser(ReasoningParser):
    turn_boundaries = ("<|im_start|>", "<|im_end|>")
    implicit_ends = (TOOL_CALL_START,)

    def _markers(self) -> tuple[str, ...]:
        if self._state == "reasoning":
            return (self.start_tag, self.end_tag, *self.implicit_ends)
        return (self.end_tag,) if self._state == "content" else ()

    def _on_marker(self, marker: str) -> str:
        if self._state != "reasoning" or marker == self.start_tag:
            return ""  # <think> inside reasoning, </think> inside the content: dropped
        self._state = "content"
        return "" if marker == self.end_tag else marker


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
