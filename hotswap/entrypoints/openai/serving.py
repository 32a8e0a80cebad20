"""Running engine requests for one HTTP request: several prompts at once, aborted when the
client goes away (streaming or not), and the pieces every response shares."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.params import EnginePrompt
from hotswap.entrypoints.openai.responses import (
    PromptLogprob,
    PromptTokensDetails,
    UsageInfo,
    WeightVersionSpanInfo,
)
from hotswap.entrypoints.server.errors import bad_request
from hotswap.outputs import Logprob, PromptLogprobs, RequestOutput, WeightVersionSpan
from hotswap.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)

_DONE = object()


class MergedStream:
    """One `engine.generate` per prompt, each pumped by its own task, merged in arrival
    order as (prompt index, output). `close()` cancels the pumps, which aborts whatever is
    still running in the engine and frees its KV."""

    def __init__(
        self,
        engine: AsyncLLM,
        prompts: Sequence[EnginePrompt],
        params: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str],
    ) -> None:
        """`params`: one for every prompt, or one per prompt."""
        self._engine = engine
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        self._jobs = list(zip(prompts, per_prompt, request_ids, strict=True))
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._errors: list[BaseException] = []

    async def start(self) -> None:
        """Submit every prompt; raises (after aborting the others) if the engine refused
        one, e.g. for a request id already in use."""
        for index, (prompt, params, request_id) in enumerate(self._jobs):
            stream = self._engine.generate(
                prompt.as_input(),
                params,
                request_id,
                lora_request=prompt.lora_request,
                session_id=prompt.routing.session_id,
                data_parallel_rank=prompt.routing.data_parallel_rank,
                priority=prompt.priority,
                kv_retention_s=prompt.kv_retention_s,
            )
            self._tasks.append(asyncio.create_task(self._pump(index, stream)))
        # One turn of the loop runs each pump up to its first wait, i.e. past the submit.
        await asyncio.sleep(0)
        if self._errors:
            await self.close()
            raise self._errors[0]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except Exception as e:  # handed to the consumer
            self._errors.append(e)
            self._queue.put_nowait((index, e))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self._queue.put_nowait((index, _DONE))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def collect_final(request: Request, stream: MergedStream) -> list[RequestOutput]:
    """The finished output of every prompt, in prompt order. Polls the connection while
    waiting: a client that disconnects aborts the engine requests."""

    async def consume() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in stream.outputs():
            if output.finished:
                finals[index] = output
        return [finals[i] for i in sorted(finals)]

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client disconnected: aborting %s", request.url.path)
                raise bad_request("client disconnected")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await stream.close()


def weight_spans(spans: Sequence[WeightVersionSpan]) -> list[WeightVersionSpanInfo]:
    return [
        WeightVersionSpanInfo(
            version=s.version,
            label=s.label,
            start=s.start,
            end=s.end,
            stale=s.stale,
            lora_name=s.lora_name,
            lora_version=s.lora_version,
        )  # fmt: skip
        for s in spans
    ]


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> UsageInfo:
    """`cached_tokens` None: no prompt_tokens_details (the server flag is off)."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


def token_text(token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
    if as_ids or logprob is None or logprob.decoded_token is None:
        return f"token_id:{token_id}"
    return logprob.decoded_token


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_info(
    logprobs: PromptLogprobs | None,
) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` field: None first, then {token id: logprob, rank, text}."""
    if logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            token: PromptLogprob(
                logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token, lp in entries.items()
        }
        for entries in logprobs
    ]


def engine_ids(base_id: str, count: int) -> list[str]:
    """The response id itself for one prompt (so /abort_requests takes it), else `{id}-{i}`."""
    return [base_id] if count == 1 else [f"{base_id}-{i}" for i in range(count)]
