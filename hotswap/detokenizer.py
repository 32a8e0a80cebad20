"""Incremental detokenization: generated token ids to text, correct for multi-byte UTF-8,
with stop-string detection and hold-back for streaming."""

from __future__ import annotations

from collections.abc import Sequence

from hotswap.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first generated token, so that decoders which drop a leading
# space at the start of a sequence (Metaspace/SentencePiece) keep it, as in vLLM and HF streaming.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes and a non-special token carries at least one byte, so a
# character not completed by the 3 tokens after its start never will be (see _force_read).
_MAX_CHAR_TOKENS = 4


def _find_stop(region: str, new_start: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string occurrence in `region` that ends earliest within region[new_start:]
    (ties: the longer one), as (stop, start index); None if there is none. Earliest *end* is what
    a token-by-token scan would see first, so the result doesn't depend on update() chunking."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        i = region.find(stop, max(0, new_start - len(stop) + 1))
        if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
            best = (i + len(stop), i, stop)
    return None if best is None else (best[2], best[1])


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, correct for multi-byte UTF-8
    (never emits U+FFFD for a character split across tokens), and finds stop strings.

    Decoding uses vLLM's prefix/read offsets over a small window of ids: the window is decoded
    and the text beyond the already-emitted prefix is emitted once it does not end in U+FFFD.
    Each update() costs O(new tokens + window), independent of the total length; the output is
    kept as a list of chunks for the same reason. For byte-level BPE the concatenated output
    equals `tokenizer.decode(generated_ids)`; for Metaspace decoders the first generated word
    keeps its leading space (decoded in the prompt's context), as in vLLM.

    `spaces_between_special_tokens` is accepted for API compatibility; like transformers' fast
    tokenizers (and vLLM's fast detokenizer) it has no effect.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        del spaces_between_special_tokens  # no effect with fast tokenizers, see class docstring
        self._backend_decode = tokenizer._backend.decode
        self._skip = skip_special_tokens
        # Skipped ids never produce text in any context, so dropping them up front keeps the
        # window small even when the model emits long runs of special tokens.
        self._dropped_ids = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max(map(len, self._stops), default=0)
        # Text that may still be cut by a stop string must not be streamed yet; when the stop
        # string is kept in the output, nothing already emitted can ever be cut.
        self._holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._ids = self._prompt_context(prompt_ids)  # window: ids[0:read] decode to _prefix_text
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._chunks: list[str] = []
        self._len = 0  # total length of _chunks
        self._sent = 0  # characters already returned by get_delta
        self._done = False
        self.matched_stop: str | None = None

    # -- public API ----------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All output text so far (after stop-string truncation). O(length), cached until the
        next update, so read it when needed rather than per token."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        return self._done

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append generated ids; return the stop string if one now appears in the output (which
        is then truncated and the detokenizer finished), else None. Ignored once finished."""
        if self._done:
            return None
        dropped = self._dropped_ids
        ids = [t for t in new_token_ids if t not in dropped] if dropped else list(new_token_ids)
        if not ids:
            return None
        self._ids.extend(ids)
        return self._append(self._read_new_text(), check_stop)

    def finish(self) -> str | None:
        """End the stream: emit text still held for an incomplete UTF-8 sequence (as U+FFFD,
        exactly as decode() would) and finish. Returns a stop string found in that text, if any.
        Idempotent; get_delta(finished=True) calls it."""
        if self._done:
            return None
        text = self._decode(self._ids)
        stop = self._append(text[len(self._prefix_text) :], check_stop=True)
        self._done = True
        return stop

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls. Until finished, the last (max stop length - 1)
        characters are held back so that a partial stop string is never streamed and later cut."""
        if finished:
            self.finish()
        end = self._len if finished else self._len - self._holdback
        if end <= self._sent:
            return ""
        delta = self._suffix(self._len - self._sent)[: end - self._sent]
        self._sent = end
        return delta

    # -- decoding ------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._backend_decode(ids, skip_special_tokens=self._skip)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        context: list[int] = []
        for token_id in reversed(prompt_ids):
            if len(context) == _PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._dropped_ids:
                context.append(token_id)
        context.reverse()
        # A prompt ending inside a UTF-8 character would merge with the first generated bytes and
        # make the output differ from decode(generated ids): decode without context then.
        return [] if self._decode(context).endswith(_REPLACEMENT_CHAR) else context

    def _read_new_text(self) -> str:
        """Text that became final with the ids just added to the window ("" if none yet)."""
        text = self._decode(self._ids)
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            return self._advance(len(self._ids), text)
        if len(self._ids) - self._read >= _MAX_CHAR_TOKENS:
            return self._force_read(text)
        return ""

    def _force_read(self, text: str) -> str:
        """Emit up to 3 tokens before the end when the trailing U+FFFD is invalid bytes rather
        than an incomplete character (e.g. a model emitting garbage), so the window stays small.
        If 3 later tokens did not complete a character at `split`, splitting there gives the same
        text as decoding in one piece, and it is final."""
        split = len(self._ids) - (_MAX_CHAR_TOKENS - 1)
        head = self._decode(self._ids[:split])
        if len(head) <= len(self._prefix_text) or head + self._decode(self._ids[split:]) != text:
            return ""
        return self._advance(split, head)

    def _advance(self, read_to: int, text: str) -> str:
        """Emit text (the decode of window[:read_to]) beyond the prefix; slide the window so that
        the last emitted tokens become the new prefix (context for the next ones)."""
        new_text = text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = read_to - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return new_text

    # -- output text and stop strings ----------------------------------------------------------

    def _append(self, new_text: str, check_stop: bool) -> str | None:
        if not new_text:
            return None
        if not (check_stop and self._stops):
            self._push(new_text)
            return None
        tail = self._suffix(self._max_stop_len - 1)  # a stop may straddle old and new text
        found = _find_stop(tail + new_text, len(tail), self._stops)
        if found is None:
            self._push(new_text)
            return None
        stop, start = found
        cut = start + (len(stop) if self._include_stop else 0) - len(tail)
        if cut >= 0:
            self._push(new_text[:cut])
        else:
            self._drop_last(-cut)
        self._done = True
        self.matched_stop = stop
        return stop

    def _push(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self._len += len(text)

    def _suffix(self, n: int) -> str:
        """The last n characters of the output, touching only the chunks that hold them."""
        if n <= 0:
            return ""
        parts: list[str] = []
        size = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            size += len(chunk)
            if size >= n:
                break
        return "".join(reversed(parts))[-n:]

    def _drop_last(self, n: int) -> None:
        """Remove the last n characters (a stop string reaching back into earlier text)."""
        self._len -= n
        while n > 0:
            last = self._chunks.pop()
            if len(last) > n:
                self._chunks.append(last[: len(last) - n])
            n -= len(last)
