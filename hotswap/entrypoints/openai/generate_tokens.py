"""POST /inference/v1/generate, vLLM 0.32's token-in/token-out route: prompt token ids and
vLLM's `SamplingParams` in; the engine's token ids and logprobs out, in vLLM's shape
(vLLM: entrypoints/scale_out/token_in_token_out/serving.py).

Invariants, and why:
- The prompt is `token_ids` exactly as sent and the output ids are exactly the engine's:
  nothing is decoded and re-encoded on the way, so a multi-turn client that appends the
  ids it got back never sees tokenization drift (the README's multi-turn recipe).
- Logprobs are the engine's numbers (clamped to -9999 as JSON has no -inf or NaN), in
  vLLM's order: the sampled token first, then the others by rank, cut at
  max(logprobs, 1) entries, whatever the output mode.
- One engine request, id `generate-tokens-<X-Request-Id header | body request_id |
  uuid>` as vLLM names it, so /abort_requests takes the id the client got back.
- `weight_versions` (vLLM's field, hotswap's provenance added per span: see
  `GenerateWeightSpan`) covers the whole output: on the choice when not streaming, on
  each choice's final chunk when streaming (null before), as vLLM sets it.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request, Response

from hotswap.entrypoints.openai.generate_params import (
    check_unsupported_generate,
    gate_after_thinking,
    generate_prompt,
    generate_sampling_params,
    prepare_generate_params,
)
from hotswap.entrypoints.openai.generate_protocol import (
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GeneratePromptTokensDetails,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    GenerateTextChoice,
    GenerateTokensChoice,
    GenerateUsage,
    GenerateWeightSpan,
    TextLogProbs,
)
from hotswap.entrypoints.openai.params import check_model, model_name
from hotswap.entrypoints.openai.responses import (
    ChatLogProb,
    ChatLogProbsContent,
    encode_routed_experts,
)
from hotswap.entrypoints.openai.serving import (
    MIN_LOGPROB,
    MergedStream,
    collect_final,
    prompt_logprobs_info,
)
from hotswap.entrypoints.openai.streaming import (
    _SPLITLINES_BREAKS,
    SSE_DONE,
    SSEResponse,
    sse_error,
)
from hotswap.entrypoints.server.limits import off_loop
from hotswap.entrypoints.server.routing import request_routing
from hotswap.entrypoints.server.state import get_engine, get_server_config
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from hotswap.tokenizer import Tokenizer

# Chunk fields vLLM leaves out of a stream event while they are null.
_OMITTED_WHEN_NULL = ("prompt_token_ids", "mm_placeholders", "metrics")


@dataclass
class GenerateContext:
    """What every part of one response needs; `logprobs`: sampling_params.logprobs."""

    request_id: str
    model: str
    body: GenerateRequest
    logprobs: int | None
    as_ids: bool  # --return-tokens-as-token-ids: text-mode tokens as "token_id:N"
    cached_details: bool
    created: int
    tokenizer: Tokenizer
    # vLLM's mm_placeholders, with return_token_ids: {"image": [{"offset", "length"}]}
    mm_placeholders: dict[str, Any] | None = None

    @property
    def text_mode(self) -> bool:
        return self.body.output_mode == "text"


async def create_generate(body: GenerateRequest, request: Request) -> Response:
    engine = get_engine(request)
    server = get_server_config(request)
    lora = check_model(request, body.model)
    check_unsupported_generate(body)
    params = generate_sampling_params(
        body.sampling_params, stream=bool(body.stream), defaults=engine.config.default_sampling
    )
    server.structured_outputs.apply(params.structured_outputs)
    prompt = generate_prompt(engine, body)
    prompt.lora_request = lora
    prompt.routing = request_routing(request, body.session_id)
    prompt.priority = body.priority
    prompt.kv_retention_s = body.kv_retention_s
    # decoding the prompt (reasoning gate) and compiling a grammar take time: off the loop
    await off_loop(gate_after_thinking, engine, server, body, params)
    await off_loop(prepare_generate_params, engine, params)
    base = request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
    ctx = GenerateContext(
        request_id=f"generate-tokens-{base}",
        model=model_name(request, lora),
        body=body,
        logprobs=body.sampling_params.logprobs,
        as_ids=server.return_tokens_as_token_ids,
        cached_details=server.enable_prompt_tokens_details,
        created=int(time.time()),
        tokenizer=engine.tokenizer,
    )
    if prompt.placeholders and body.return_token_ids:
        ranges = [{"offset": offset, "length": length} for offset, length in prompt.placeholders]
        ctx.mm_placeholders = {"image": ranges}
    stream = MergedStream(engine, [prompt], params, [ctx.request_id])
    await stream.start()
    headers = {"X-Request-Id": ctx.request_id}
    if body.stream:
        return SSEResponse(stream_generate(ctx, stream), stream.close, headers)
    (final,) = await collect_final(request, stream)
    response = generate_response(ctx, final)
    return Response(response.model_dump_json(), media_type="application/json", headers=headers)


def generate_response(ctx: GenerateContext, final: RequestOutput) -> GenerateResponse:
    """vLLM's non-streaming answer; a choice that never finished reads "stop" as there."""
    outputs = sorted(final.outputs, key=lambda c: c.index)
    choices = [
        _choice(ctx, comp, comp.finish_reason or "stop", weight_spans_of(comp.weight_versions))
        for comp in outputs
    ]
    completion = sum(len(c.token_ids) for c in outputs)
    cached = final.num_cached_tokens if ctx.cached_details else None
    return GenerateResponse(
        request_id=ctx.request_id,
        model=ctx.model,
        created=ctx.created,
        usage=_usage(len(final.prompt_token_ids), completion, cached),
        prompt_logprobs=prompt_logprobs_info(final.prompt_logprobs),
        prompt_token_ids=list(final.prompt_token_ids) if ctx.body.return_token_ids else None,
        mm_placeholders=ctx.mm_placeholders,
        output_mode=ctx.body.output_mode,
        choices=choices,
    )


def _usage(prompt: int, completion: int, cached: int | None) -> GenerateUsage:
    details = None if cached is None else GeneratePromptTokensDetails(cached_tokens=cached)
    return GenerateUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def _choice(
    ctx: GenerateContext,
    comp: CompletionOutput,
    finish_reason: str | None,
    spans: list[GenerateWeightSpan] | None,
) -> GenerateChoice:
    common = {
        "index": comp.index,
        "finish_reason": finish_reason,
        "stop_reason": comp.stop_reason,
        "token_ids": list(comp.token_ids),
        "weight_versions": spans,
        "routed_experts": encode_routed_experts(comp.routed_experts),  # on the final output
        "bf16_logprobs": comp.bf16_logprobs,
    }
    if ctx.text_mode:
        return GenerateTextChoice(text=comp.text, logprobs=_text_logprobs(ctx, comp), **common)
    return GenerateTokensChoice(logprobs=_token_logprobs(ctx, comp), **common)


def weight_spans_of(spans: Sequence[WeightVersionSpan]) -> list[GenerateWeightSpan]:
    """The spans in vLLM's shape (`version`: the label), adjacent pieces of one weight
    version joined (a stream reports one piece per delta)."""
    merged: list[WeightVersionSpan] = []
    for span in spans:
        last = merged[-1] if merged else None
        same = last is not None and (
            last.version,
            last.label,
            last.stale,
            last.lora_version,
            last.end,
        ) == (span.version, span.label, span.stale, span.lora_version, span.start)
        if same:
            merged[-1] = replace(last, end=span.end)  # type: ignore[arg-type]
        else:
            merged.append(span)
    return [
        GenerateWeightSpan(
            version=s.label,
            start=s.start,
            end=s.end,
            label=s.label,
            weight_gen=s.version,
            stale=s.stale,
            lora_name=s.lora_name,
            lora_version=s.lora_version,
        )
        for s in merged
    ]


def clamp(value: float) -> float:
    """vLLM's floor for a logprob in JSON: -inf and NaN become -9999."""
    return MIN_LOGPROB if math.isnan(value) else max(value, MIN_LOGPROB)


def ordered_candidates(
    token_id: int, entries: dict[int, Logprob], num: int
) -> list[tuple[int, Logprob]]:
    """vLLM's top_logprobs: the sampled token, then the others by rank, max(num, 1) in
    all (so a sampled token outside the top `num` displaces the last of them, as there)."""
    others = sorted(
        ((t, lp) for t, lp in entries.items() if t != token_id),
        key=lambda item: (item[1].rank is None, item[1].rank or 0),
    )
    return [(token_id, entries[token_id]), *others][: max(num, 1)]


def _token_logprobs(ctx: GenerateContext, comp: CompletionOutput) -> GenerateLogProbs | None:
    if ctx.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(comp.token_ids, comp.logprobs or []):
        own = entries.get(token_id)
        if own is None:  # vLLM's sentinel when the sampled token has no entry
            content.append(GenerateLogProbsContent(token_id=token_id, logprob=MIN_LOGPROB))
            continue
        top = [
            GenerateLogProb(token_id=t, logprob=clamp(lp.logprob), rank=lp.rank or None)
            for t, lp in ordered_candidates(token_id, entries, ctx.logprobs)
        ]
        content.append(
            GenerateLogProbsContent(
                token_id=token_id,
                logprob=clamp(own.logprob),
                rank=own.rank or None,
                top_logprobs=top,
            )
        )
    return GenerateLogProbs(content=content)


def _text_logprobs(ctx: GenerateContext, comp: CompletionOutput) -> TextLogProbs | None:
    if ctx.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(comp.token_ids, comp.logprobs or []):
        own = entries.get(token_id)
        if own is None:
            content.append(ChatLogProbsContent(**_text_logprob(ctx, token_id, None).model_dump()))
            continue
        top = [
            _text_logprob(ctx, t, lp)
            for t, lp in ordered_candidates(token_id, entries, ctx.logprobs)
        ]
        entry = _text_logprob(ctx, token_id, own).model_dump()
        content.append(ChatLogProbsContent(**entry, top_logprobs=top))
    return TextLogProbs(content=content)


def _text_logprob(ctx: GenerateContext, token_id: int, logprob: Logprob | None) -> ChatLogProb:
    """Token text and UTF-8 bytes as vLLM's text level; "token_id:N" and no bytes under
    --return-tokens-as-token-ids."""
    value = MIN_LOGPROB if logprob is None else clamp(logprob.logprob)
    if ctx.as_ids:
        return ChatLogProb(token=f"token_id:{token_id}", logprob=value, bytes=None)
    token = logprob.decoded_token if logprob is not None else None
    if token is None:
        token = ctx.tokenizer.decode([token_id], skip_special_tokens=False)
    return ChatLogProb(token=token, logprob=value, bytes=list(token.encode("utf-8", "replace")))


# -- streaming ----------------------------------------------------------------------------


@dataclass
class ChoiceStream:
    """One choice's stream: tokens sent, provenance so far, a delta held back by
    `stream_interval`, whether its first chunk went out and whether it finished."""

    num_tokens: int = 0
    spans: list[WeightVersionSpan] = field(default_factory=list)
    held: CompletionOutput | None = None
    started: bool = False
    finished: bool = False


def _concat(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = None if a.logprobs is None and b.logprobs is None else []
    if logprobs is not None:
        logprobs = [*(a.logprobs or []), *(b.logprobs or [])]
    return replace(
        b,
        text=a.text + b.text,
        token_ids=[*a.token_ids, *b.token_ids],
        logprobs=logprobs,
        weight_versions=[*a.weight_versions, *b.weight_versions],
    )


def take_delta(
    state: ChoiceStream, delta: CompletionOutput, interval: int | None, text_mode: bool
) -> CompletionOutput | None:
    """The delta to send now, or None: vLLM sends a chunk when there are new tokens, a
    finish or (text level) new text; `stream_interval` batches that many tokens per
    chunk, the first and the final ones going out at once as in vLLM."""
    if state.finished:
        return None
    state.spans += delta.weight_versions
    merged = delta if state.held is None else _concat(state.held, delta)
    state.held = None
    if not (merged.token_ids or merged.finished or (text_mode and merged.text)):
        return None
    if interval and state.started and not merged.finished and len(merged.token_ids) < interval:
        state.held = merged
        return None
    state.started, state.finished = True, merged.finished
    state.num_tokens += len(merged.token_ids)
    return merged


def _event(chunk: GenerateStreamResponse, *, final: bool = False) -> str:
    """vLLM's dumps: a choice chunk leaves out its null prompt_token_ids,
    mm_placeholders and metrics; the usage chunk leaves out every null."""
    if final:
        data = chunk.model_dump_json(exclude_none=True)
    else:
        omit = {name for name in _OMITTED_WHEN_NULL if getattr(chunk, name) is None}
        data = chunk.model_dump_json(exclude=omit)
    return f"data: {data.translate(_SPLITLINES_BREAKS)}\n\n"


async def stream_generate(ctx: GenerateContext, stream: MergedStream) -> AsyncIterator[str]:
    body = ctx.body
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    interval = body.sampling_params.stream_interval
    states: dict[int, ChoiceStream] = {}
    prompt_len = cached = 0
    send_prompt_ids = bool(body.return_token_ids)
    try:
        try:
            async for _, output in stream.outputs():
                prompt_len, cached = len(output.prompt_token_ids), output.num_cached_tokens
                for delta in sorted(output.outputs, key=lambda c: c.index):
                    state = states.setdefault(delta.index, ChoiceStream())
                    ready = take_delta(state, delta, interval, ctx.text_mode)
                    if ready is None:
                        continue
                    spans = weight_spans_of(state.spans) if ready.finished else None
                    chunk = GenerateStreamResponse(
                        request_id=ctx.request_id,
                        output_mode=body.output_mode,
                        choices=[_choice(ctx, ready, ready.finish_reason, spans)],
                    )
                    if send_prompt_ids:
                        chunk.prompt_token_ids, send_prompt_ids = (
                            list(output.prompt_token_ids),
                            False,
                        )
                        chunk.mm_placeholders = ctx.mm_placeholders
                    if continuous:
                        chunk.usage = _usage(prompt_len, state.num_tokens, None)
                    yield _event(chunk)
            if include_usage:
                completion = sum(s.num_tokens for s in states.values())
                usage = _usage(prompt_len, completion, cached if ctx.cached_details else None)
                last = GenerateStreamResponse(
                    request_id=ctx.request_id, output_mode=body.output_mode, choices=[], usage=usage
                )
                yield _event(last, final=True)
        except Exception as e:  # the status line is sent: report in-band, as vLLM does
            yield sse_error(e)
        yield SSE_DONE
    finally:
        await stream.close()
