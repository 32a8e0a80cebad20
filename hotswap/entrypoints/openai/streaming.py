"""Server-sent events and the per-choice bookkeeping shared by both streaming endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hotswap.engine.errors import EngineDeadError
from hotswap.entrypoints.openai.protocol import SamplingRequest
from hotswap.entrypoints.openai.responses import UsageInfo
from hotswap.entrypoints.openai.serving import make_usage
from hotswap.entrypoints.server.errors import APIError
from hotswap.outputs import CompletionOutput, RequestOutput

SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """`text/event-stream`. However the response ends (done, error, client disconnect
    before or during the stream), the body generator is closed and `cleanup` awaited, so
    the engine requests behind it are aborted and their KV freed."""

    def __init__(
        self,
        content: AsyncIterator[str],
        cleanup: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                await self._cleanup()


# Line breaks to Python's str.splitlines (and so to httpx's iter_lines) that JSON leaves
# raw inside strings; escaped, an event stays one line for every client.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json().translate(_SPLITLINES_BREAKS)}\n\n"


def sse_error(error: BaseException) -> str:
    """The error envelope as one event (the status line has long been sent)."""
    if isinstance(error, APIError):
        status, message = error.status, error.message
    elif isinstance(error, ValueError):
        status, message = 400, str(error)
    elif isinstance(error, EngineDeadError):
        status, message = 503, f"engine is not available: {error}"
    else:
        status, message = 500, f"internal error: {type(error).__name__}: {error}"
    body = {"error": {"message": message, "type": type(error).__name__, "code": status}}
    return f"data: {json.dumps(body)}\n\n"


def continuous_usage(body: SamplingRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage on every chunk."""
    options = body.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


@dataclass
class ChoiceProgress:
    prompt_index: int
    text_len: int = 0  # characters streamed so far (completion logprobs' text_offset)
    num_tokens: int = 0
    started: bool = False  # its first chunk (role / prompt_token_ids) went out
    finished: bool = False


@dataclass
class StreamTracker:
    """Which choices have started and finished, and the running usage."""

    n: int
    prompt_lens: list[int]
    cached: list[int] = field(default_factory=list)
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cached = [0] * len(self.prompt_lens)
        for p in range(len(self.prompt_lens)):
            for j in range(self.n):
                self.choices[p * self.n + j] = ChoiceProgress(p)

    def updates(
        self, prompt_index: int, output: RequestOutput
    ) -> list[tuple[int, ChoiceProgress, CompletionOutput]]:
        """(choice index, progress, delta) for each choice with something new to send."""
        self.cached[prompt_index] = max(self.cached[prompt_index], output.num_cached_tokens)
        result = []
        for delta in output.outputs:
            index = prompt_index * self.n + delta.index
            progress = self.choices[index]
            if progress.finished or not (delta.text or delta.token_ids or delta.finished):
                continue
            progress.num_tokens += len(delta.token_ids)
            progress.finished = delta.finished
            result.append((index, progress, delta))
        return result

    def choice_usage(self, progress: ChoiceProgress) -> UsageInfo:
        return make_usage(self.prompt_lens[progress.prompt_index], progress.num_tokens, None)

    def usage(self, with_cached: bool) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices.values())
        cached = sum(self.cached) if with_cached else None
        return make_usage(sum(self.prompt_lens), completion, cached)
