"""Tool calls wrapped in tags, `<tool_call>BODY</tool_call>` (hermes, qwen3_coder).

A region opens at the start tag and closes at the first end tag after it, or at the end of
the output. Outside regions the text is content; a partial start tag at the end of what was
received is held back until the next delta decides it. A region is held whole until it
closes, then its body is parsed: valid, it yields its calls; invalid, or open at the end of
the output and not complete, it is text again, tags and all.
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.base import ToolParser, partial_overlap


class TaggedToolParser(ToolParser):
    """Subclasses give the tags and `_parse_region`."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._inside = False  # `_buf` starts inside a region (its start tag consumed)
        self._region: list[str] = []  # the open region's text before `_buf`, no end tag in it

    def _parse_region(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        """[(name, arguments JSON)] of a region's body, or None if it is not valid calls.
        `closed`: the end tag was seen (else the output ended inside the region)."""
        raise NotImplementedError

    def _advance(self, eof: bool) -> None:
        while self._buf:
            if self._inside:
                if not self._close_region(eof):
                    return
                continue
            i = self._buf.find(self.start_tag)
            if i < 0:
                keep = 0 if eof else partial_overlap(self._buf, self.start_tag)
                self._text(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return
            self._text(self._buf[:i])
            self._buf = self._buf[i + len(self.start_tag) :]
            self._inside = True
        if self._inside and eof:  # a start tag was the last thing in the output
            self._close_region(eof)

    def _close_region(self, eof: bool) -> bool:
        """Decide the open region if its end tag arrived (or at eof); False to wait."""
        j = self._buf.find(self.end_tag)
        if j < 0 and not eof:
            # Keep only what an end tag split across deltas could start in, so a long
            # region is scanned once and never copied whole per delta.
            cut = len(self._buf) - (len(self.end_tag) - 1)
            if cut > 0:
                self._region.append(self._buf[:cut])
                self._buf = self._buf[cut:]
            return False
        closed = j >= 0
        body = "".join(self._region) + (self._buf[:j] if closed else self._buf)
        self._buf = self._buf[j + len(self.end_tag) :] if closed else ""
        self._inside, self._region = False, []
        try:
            calls = self._parse_region(body, closed)
        except Exception:  # model output never makes a parser raise
            calls = None
        if calls:
            for name, arguments in calls:
                self._call(name, arguments)
        else:
            self._text(self.start_tag + body + (self.end_tag if closed else ""))
        return True
