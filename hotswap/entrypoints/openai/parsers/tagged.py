"""Tool calls wrapped in tags, `<tool_call>BODY</tool_call>` (hermes, qwen3_coder).

A region opens at the start tag and closes at the first end tag after it, or at the end of
the output. Outside regions the text is content; a partial start tag at the end of what was
received is held back until the next delta decides it. Inside a region the body is handed
to the subclass as it arrives (less a partial end tag at the end of what was received,
held until decided), so its calls stream while they are generated. A region in which no
call started by the time it closes is text again, tags and all; one in which a call
started is not (the subclass closes a call the region's end cut off).
"""

from __future__ import annotations

from hotswap.entrypoints.openai.parsers.base import ToolParser, partial_overlap


class TaggedToolParser(ToolParser):
    """Subclasses give the tags and `_region_open`, `_region_feed` and `_region_close`."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._inside = False  # `_buf` starts inside a region (its start tag consumed)
        self._region: list[str] = []  # the open region's body before `_buf`, while it may be text
        self._calls_before = 0  # calls started before the open region

    def _region_open(self) -> None:
        """A region begins: reset the body reader."""
        raise NotImplementedError

    def _region_feed(self, body: str) -> None:
        """The next piece of the open region's body (no end tag in it), in order."""
        raise NotImplementedError

    def _region_close(self, closed: bool) -> None:
        """The body is all there: decide what is still open. `closed`: the end tag was seen
        (else the output ended inside the region)."""
        raise NotImplementedError

    def _advance(self, eof: bool) -> None:
        while self._buf:
            if self._inside:
                if not self._read_region(eof):
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
            self._inside, self._region, self._calls_before = True, [], self._n_calls
            self._region_open()
        if self._inside and eof:  # a start tag was the last thing in the output
            self._read_region(eof)

    def _read_region(self, eof: bool) -> bool:
        """Hand the region's body on as far as it is decided, and close the region if its end
        tag arrived (or at eof); False to wait for more text."""
        j = self._buf.find(self.end_tag)
        if j < 0 and not eof:
            cut = len(self._buf) - partial_overlap(self._buf, self.end_tag)
            if cut > 0:
                self._body(self._buf[:cut])
                self._buf = self._buf[cut:]
            return False
        closed = j >= 0
        self._body(self._buf[:j] if closed else self._buf)
        self._buf = self._buf[j + len(self.end_tag) :] if closed else ""
        self._region_close(closed)
        if self._n_calls == self._calls_before:  # no call: the region is text
            self._text(self.start_tag + "".join(self._region) + (self.end_tag if closed else ""))
        self._inside, self._region = False, []
        return True

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._n_calls == self._calls_before:  # the region may still be text
            self._region.append(text)
        self._region_feed(text)
