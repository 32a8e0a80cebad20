"""POST /v1/completions: one engine request per prompt; choice index = prompt * n + j."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request, Response

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    apply_server_flags,
    base_request_id,
    check_context_length,
    check_model,
    check_unsupported,
    model_name,
    prepare_prompt,
    sampling_params,
)
from hotswap.entrypoints.openai.protocol import CompletionRequest
from hotswap.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamChoice,
    PromptLogprob,
    encode_routed_experts,
    sglext_of,
)
from hotswap.entrypoints.openai.serving import (
    MergedStream,
    clamp_logprob,
    collect_final,
    engine_ids,
    make_usage,
    prompt_logprobs_info,
    token_text,
    weight_spans,
)
from hotswap.entrypoints.openai.streaming import (
    SSE_DONE,
    SSEResponse,
    StreamTracker,
    continuous_usage,
    sse,
    sse_error,
)
from hotswap.entrypoints.server.limits import off_loop
from hotswap.entrypoints.server.routing import request_routing
from hotswap.entrypoints.server.state import get_engine, get_server_config
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput
from hotswap.tokenizer import Tokenizer


@dataclass
class CompletionContext:
    id: str
    model: str
    body: CompletionRequest
    prompts: list[EnginePrompt]
    echo_texts: list[str]  # per prompt; empty strings without echo
    cached_details: bool
    created: int
    tokenizer: Tokenizer

    def chunk(self, choices: list[CompletionChoice], **extra: object) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    engine = get_engine(request)
    lora = check_model(request, body.model)
    check_unsupported(body)
    apply_server_flags(request, body)
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed tokens are scored too
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    sampling = sampling_params(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        stream=body.stream,
        prompt_logprobs=prompt_logprobs,
        defaults=engine.config.default_sampling,
    )
    get_server_config(request).structured_outputs.apply(sampling.structured_outputs)
    prompts = await off_loop(  # tokenizing a long prompt must not stall other clients
        lambda: [
            prepare_prompt(
                engine,
                prompt,
                add_special_tokens=body.add_special_tokens,
                truncate=body.truncate_prompt_tokens,
            )
            for prompt in body.prompt
        ]
    )
    for prompt in prompts:
        check_context_length(engine, prompt, body.max_tokens, "body.max_tokens")
        prompt.cache_salt = body.cache_salt
        prompt.lora_request = lora
        prompt.routing = request_routing(request, body.session_id)
        prompt.priority = body.priority
        prompt.kv_retention_s = body.kv_retention_s
    base_id = base_request_id(request, body.request_id, "cmpl")
    ctx = CompletionContext(
        id=base_id,
        model=model_name(request, lora),
        body=body,
        prompts=prompts,
        echo_texts=[_echo_text(engine, p) if body.echo else "" for p in prompts],
        cached_details=get_server_config(request).enable_prompt_tokens_details,
        created=int(time.time()),
        tokenizer=engine.tokenizer,
    )
    stream = MergedStream(engine, prompts, sampling, engine_ids(base_id, len(prompts)))
    await stream.start()
    headers = {"X-Request-Id": base_id}
    if body.stream:
        return SSEResponse(stream_completion(ctx, stream), stream.close, headers)
    finals = await collect_final(request, stream)
    response = completion_response(ctx, finals)
    return Response(response.model_dump_json(), media_type="application/json", headers=headers)


def _echo_text(engine: AsyncLLM, prompt: EnginePrompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def completion_response(ctx: CompletionContext, finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    num_prompt = num_completion = num_cached = 0
    for p_index, output in enumerate(finals):
        num_prompt += len(output.prompt_token_ids)
        num_cached += output.num_cached_tokens
        for comp in output.outputs:
            num_completion += len(comp.token_ids)
            choices.append(_choice(ctx, p_index, output, comp))
    usage = make_usage(num_prompt, num_completion, num_cached if ctx.cached_details else None)
    return ctx.chunk(choices, usage=usage, sglext=sglext_of(ctx.body, finals[0]))


def _choice(
    ctx: CompletionContext, p_index: int, output: RequestOutput, comp: CompletionOutput
) -> CompletionChoice:
    body, echo = ctx.body, ctx.echo_texts[p_index]
    logprobs = _logprobs(ctx, comp, len(echo))
    if logprobs is not None and body.echo:
        logprobs = _echo_logprobs(ctx, output).extend(logprobs)
    return CompletionChoice(
        index=p_index * body.n + comp.index,
        text=echo + comp.text,
        logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(ctx, output),
        finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason,
        token_ids=list(comp.token_ids) if body.return_token_ids else None,
        prompt_token_ids=list(output.prompt_token_ids) if body.return_token_ids else None,
        weight_versions=weight_spans(comp.weight_versions),
        routed_experts=encode_routed_experts(comp.routed_experts),
        bf16_logprobs=comp.bf16_logprobs,
    )


def _logprobs(
    ctx: CompletionContext, comp: CompletionOutput, initial_offset: int
) -> CompletionLogProbs | None:
    if ctx.body.logprobs is None or comp.logprobs is None:
        return None
    return completion_logprobs(
        comp.token_ids, comp.logprobs, initial_offset, ctx.body.return_tokens_as_token_ids
    )


def _prompt_logprobs(
    ctx: CompletionContext, output: RequestOutput
) -> list[dict[int, PromptLogprob] | None] | None:
    if ctx.body.prompt_logprobs is None:
        return None
    return prompt_logprobs_info(output.prompt_logprobs)


def _echo_logprobs(ctx: CompletionContext, output: RequestOutput) -> CompletionLogProbs:
    """The legacy logprobs of the echoed prompt: nothing scores its first token (null)."""
    scored = output.prompt_logprobs or []
    as_ids = ctx.body.return_tokens_as_token_ids
    result = CompletionLogProbs()
    offset = 0
    for token_id, entries in zip(output.prompt_token_ids, scored):
        own = entries.get(token_id) if entries is not None else None
        if own is None and not as_ids:  # the first token: no logprob, but it has a text
            own = Logprob(0.0, None, ctx.tokenizer.decode([token_id], skip_special_tokens=False))
        token = token_text(token_id, own, as_ids)
        result.text_offset.append(offset)
        result.tokens.append(token)
        result.token_logprobs.append(None if entries is None else clamp_logprob(own.logprob))
        result.top_logprobs.append(
            None
            if entries is None
            else {token_text(t, lp, as_ids): clamp_logprob(lp.logprob) for t, lp in entries.items()}
        )
        offset += len(token)
    return result


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    initial_offset: int,
    as_ids: bool,
) -> CompletionLogProbs:
    """OpenAI's legacy shape; top_logprobs holds the top-k plus the sampled token."""
    result = CompletionLogProbs()
    offset, last_len = initial_offset, 0
    for i, (token_id, entries) in enumerate(zip(token_ids, logprobs)):
        sampled = entries.get(token_id)
        token = token_text(token_id, sampled, as_ids)
        offset = initial_offset if i == 0 else offset + last_len
        last_len = len(token)
        result.text_offset.append(offset)
        result.tokens.append(token)
        result.token_logprobs.append(None if sampled is None else clamp_logprob(sampled.logprob))
        result.top_logprobs.append(
            {token_text(t, lp, as_ids): clamp_logprob(lp.logprob) for t, lp in entries.items()}
        )
    return result


async def stream_completion(ctx: CompletionContext, stream: MergedStream) -> AsyncIterator[str]:
    body = ctx.body
    tracker = StreamTracker(body.n, [len(p.token_ids) for p in ctx.prompts])
    try:
        # With logprobs, an echo waits for the prompt's logprobs (they come with the first
        # token); without, it goes out at once.
        scored_echo = body.echo and body.logprobs is not None
        try:
            if body.echo and not scored_echo:
                for index, progress in tracker.choices.items():
                    progress.started = True
                    progress.text_len = len(ctx.echo_texts[progress.prompt_index])
                    yield sse(ctx.chunk([_echo_choice(ctx, index, progress.prompt_index)]))
            async for p_index, output in stream.outputs():
                for index, progress, delta in tracker.updates(p_index, output):
                    if scored_echo and not progress.started:
                        progress.started = True
                        progress.text_len = len(ctx.echo_texts[p_index])
                        echo = _echo_choice(ctx, index, p_index)
                        echo.logprobs = _echo_logprobs(ctx, output)
                        echo.prompt_logprobs = _prompt_logprobs(ctx, output)
                        yield sse(ctx.chunk([echo]))
                    choice = _stream_choice(ctx, index, delta, progress.text_len)
                    if not progress.started:
                        progress.started = True
                        choice.prompt_logprobs = _prompt_logprobs(ctx, output)
                        if body.return_token_ids:
                            choice.prompt_token_ids = list(output.prompt_token_ids)
                    progress.text_len += len(delta.text)
                    usage = tracker.choice_usage(progress) if continuous_usage(body) else None
                    yield sse(ctx.chunk([choice], usage=usage))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse(ctx.chunk([], usage=tracker.usage(ctx.cached_details)))
        except Exception as e:  # the status line is sent: report in-band, as vLLM does
            yield sse_error(e)
        yield SSE_DONE
    finally:
        await stream.close()


def _echo_choice(ctx: CompletionContext, index: int, p_index: int) -> CompletionChoice:
    prompt_ids = ctx.prompts[p_index].token_ids
    return CompletionStreamChoice(
        index=index,
        text=ctx.echo_texts[p_index],
        prompt_token_ids=list(prompt_ids) if ctx.body.return_token_ids else None,
        token_ids=[] if ctx.body.return_token_ids else None,
    )


def _stream_choice(
    ctx: CompletionContext, index: int, delta: CompletionOutput, text_offset: int
) -> CompletionChoice:
    return CompletionStreamChoice(
        index=index,
        text=delta.text,
        logprobs=_logprobs(ctx, delta, text_offset),
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        token_ids=list(delta.token_ids) if ctx.body.return_token_ids else None,
        weight_versions=weight_spans(delta.weight_versions),
        bf16_logprobs=delta.bf16_logprobs,
    )
