"""SGLang's native generation route, POST /generate, over hotswap's `AsyncLLM`.

What RL frameworks send (payloads as built in their sources):
- slime (slime/rollout/sglang_rollout.py `generate`): {"input_ids": [...] (or "text" plus
  "image_data"), "sampling_params": {temperature, top_p, top_k, max_new_tokens, stop,
  stop_token_ids, skip_special_tokens, no_stop_trim: true, spaces_between_special_tokens:
  false, optionally custom_params and sampling_seed}, "return_logprob": true}; the
  streaming variant adds "stream": true, its agent adapters a "rid", on-policy
  distillation max_new_tokens 0 with "logprob_start_len": 0. It reads
  meta_info.output_token_logprobs, finish_reason.type, weight_version, prompt_tokens,
  cached_tokens and the text.
- AReaL (areal/engine/sglang_remote.py `SGLangBackend`): {"input_ids", "image_data": null,
  "sampling_params": {top_p, top_k (1e8: all), max_new_tokens, temperature,
  stop_token_ids, ignore_eos, skip_special_tokens, frequency_penalty, stop},
  "return_logprob": true, "stream": false}; reads output_token_logprobs and
  finish_reason.type, resending an "abort"ed request with what it got appended.

The request follows SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py)
and SamplingParams (python/sglang/srt/sampling/sampling_params.py): a list of prompts or
n > 1 answers a list, ordered prompt by prompt, n samples each. Fields hotswap cannot honour
are refused with 400 naming them unless at their default; unknown ones are ignored with a
logged warning, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.params import UnknownFieldsRoute
from hotswap.entrypoints.openai.serving import MergedStream, collect_final
from hotswap.entrypoints.openai.streaming import SSE_DONE, SSEResponse, sse_error
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.sglang.protocol import GenerateRequest
from hotswap.entrypoints.sglang.render import ItemState, fill_missing_labels, job_stream
from hotswap.entrypoints.sglang.request import plan_jobs
from hotswap.errors import InvalidArgument

sglang_generate_router = APIRouter(route_class=UnknownFieldsRoute)  # as on the OpenAI routes


@sglang_generate_router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request) -> Response:
    started = time.monotonic()
    engine = get_engine(request)
    jobs, n, single = await plan_jobs(request, body, engine)
    stream = job_stream(engine, jobs)
    try:
        await stream.start()
    except InvalidArgument as e:
        if e.field != "request_id":
            raise
        raise bad_request(f"rid: {str(e).split(': ', 1)[1]}", "body.rid") from None
    # SGLang's items: prompt by prompt, n samples each (n > 1 is one engine request).
    items = [
        ItemState(job, job.request_id, started, engine.tokenizer) for job in jobs for _ in range(n)
    ]
    if body.stream:
        indexed = not single or n > 1  # SGLang numbers a batch's chunks
        chunks = _stream(engine, stream, items, n, indexed, body.return_prompt_token_ids)
        return SSEResponse(chunks, stream.close)
    # collect_final only iterates and closes the stream (and aborts it if the client goes)
    for p, output in enumerate(await collect_final(request, stream)):  # type: ignore[arg-type]
        for comp in output.outputs:
            items[p * n + comp.index].add(output, comp)
    await fill_missing_labels(engine, items)
    rendered = [item.render(None, body.return_prompt_token_ids) for item in items]
    result: Any = rendered[0] if single and n == 1 else rendered
    return Response(json.dumps(result, ensure_ascii=False), media_type="application/json")


async def _stream(
    engine: AsyncLLM,
    stream: MergedStream,
    items: list[ItemState],
    n: int,
    indexed: bool,
    with_prompt_ids: bool,
) -> AsyncIterator[str]:
    """SGLang's SSE: `data: {item}` whenever an item has something new, cumulative (text,
    output_ids, logprobs so far), `index` set for a batch; then `data: [DONE]`. Errors go
    in-band as `data: {"error": {...}}`, the status line having been sent."""
    try:
        try:
            async for p, output in stream.outputs():
                for delta in output.outputs:
                    index = p * n + delta.index
                    item = items[index]
                    if item.finished or not (delta.token_ids or delta.text or delta.finished):
                        continue
                    item.add(output, delta)
                    if item.finished:
                        await fill_missing_labels(engine, [item])
                    chunk = item.render(index if indexed else None, with_prompt_ids)
                    # ASCII-escaped: U+2028 and the like would split an event for some clients
                    yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # noqa: BLE001 - reported in-band, as SGLang does
            yield sse_error(e)
        yield SSE_DONE
    finally:
        await stream.close()
