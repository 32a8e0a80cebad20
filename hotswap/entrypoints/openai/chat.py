"""POST /v1/chat/completions: the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import Request, Response

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.chat_tools import (
    ChoiceParser,
    check_tool_request,
    forced_call_constraint,
    gate_constraint_after_thinking,
    merge_deltas,
    starts_thinking,
    tool_dicts,
)
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    apply_server_flags,
    base_request_id,
    check_context_length,
    check_model,
    check_unsupported,
    completion_max_tokens,
    max_tokens_param,
    model_name,
    place_images,
    prepare_prompt,
    sampling_params,
)
from hotswap.entrypoints.openai.parsers import REASONING_PARSERS, ParsedDelta
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest
from hotswap.entrypoints.openai.responses import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    encode_routed_experts,
    sglext_of,
)
from hotswap.entrypoints.openai.serving import (
    MergedStream,
    clamp_logprob,
    collect_final,
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
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.limits import check_request_chat_template, off_loop
from hotswap.entrypoints.server.routing import request_routing
from hotswap.entrypoints.server.state import ServerConfig, get_engine, get_server_config
from hotswap.lora.request import LoRARequest
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput
from hotswap.sampling_params import SamplingParams


@dataclass
class ChatContext:
    id: str
    model: str
    body: ChatCompletionRequest
    prompt: EnginePrompt
    role: str
    echo_text: str
    cached_details: bool
    created: int
    server: ServerConfig
    thinking: bool = False  # the output begins inside the model's thinking

    def parser(self) -> ChoiceParser:
        return ChoiceParser(self.body, self.server, self.thinking)

    def chunk(self, choices: list[ChatStreamChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )


async def prepare_chat(
    body: ChatCompletionRequest, request: Request
) -> tuple[LoRARequest | None, SamplingParams, EnginePrompt]:
    """What every chat route starts with (the completion, and its render): the request
    checked, its adapter, sampling parameters and rendered prompt."""
    engine = get_engine(request)
    lora = check_model(request, body.model)
    check_unsupported(body)
    apply_server_flags(request, body)
    _check_chat_options(body)
    check_tool_request(body, get_server_config(request))
    check_request_chat_template(request, body.chat_template, "body.chat_template")
    max_tokens = completion_max_tokens(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        stream=body.stream,
        structured_outputs=forced_call_constraint(body),
        defaults=engine.config.default_sampling,
    )
    prompt = await off_loop(render_chat, engine, body)  # templates and long prompts take time
    check_context_length(engine, prompt, max_tokens, max_tokens_param(body))
    return lora, sampling, prompt


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    engine = get_engine(request)
    server = get_server_config(request)
    lora, sampling, prompt = await prepare_chat(body, request)
    prompt.cache_salt, prompt.lora_request = body.cache_salt, lora
    server.structured_outputs.apply(sampling.structured_outputs)
    thinking = starts_thinking(body, server, prompt.text or "")
    if thinking and not server.structured_outputs.enable_in_reasoning:
        end_tag = REASONING_PARSERS[server.reasoning_parser].end_tag
        end_ids = engine.tokenizer.encode(end_tag, add_special_tokens=False)
        gate_constraint_after_thinking(sampling.structured_outputs, end_ids)
    role = "assistant" if body.add_generation_prompt else body.messages[-1]["role"]
    ctx = ChatContext(
        id=base_request_id(request, body.request_id, "chatcmpl"),
        model=model_name(request, lora),
        body=body,
        prompt=prompt,
        role=role,
        echo_text=_echo_text(body, role),
        cached_details=server.enable_prompt_tokens_details,
        created=int(time.time()),
        server=server,
        thinking=thinking,
    )
    prompt.routing = request_routing(request, body.session_id)
    prompt.priority = body.priority
    prompt.kv_retention_s = body.kv_retention_s
    stream = MergedStream(engine, [prompt], sampling, [ctx.id])
    await stream.start()
    headers = {"X-Request-Id": ctx.id}
    if body.stream:
        return SSEResponse(stream_chat(ctx, stream), stream.close, headers)
    (final,) = await collect_final(request, stream)
    response = chat_response(ctx, final)
    return Response(response.model_dump_json(), media_type="application/json", headers=headers)


def _check_chat_options(body: ChatCompletionRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "body.top_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message: cannot be combined with add_generation_prompt=true",
            "body.continue_final_message",
        )


def render_chat(engine: AsyncLLM, body: ChatCompletionRequest) -> EnginePrompt:
    text = apply_template(
        engine,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        documents=body.documents,
        tools=tool_dicts(body),
        template_kwargs=body.chat_template_kwargs,
    )
    prompt = prepare_prompt(
        engine,
        text,
        add_special_tokens=body.add_special_tokens,
        truncate=body.truncate_prompt_tokens,
        param="body.messages",
    )
    sources = chat_images(body.messages)
    if not sources:
        return prompt
    return place_images(engine, prompt, sources, "messages", body.mm_processor_kwargs)


def chat_images(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(field, url) of each image part, in the conversation's order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") == "image":
                found.append((f"messages[{i}].content[{j}].image_url", part["image_url"]["url"]))
    return found


def apply_template(
    engine: AsyncLLM,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    documents: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation through the chat template; any failure is 400 on `body.messages`."""
    try:
        text = engine.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            documents=documents,
            tools=tools,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, raise_exception() in the template, bad kwargs
        raise bad_request(f"messages: chat template failed: {e}", "body.messages") from None
    if not isinstance(text, str):
        raise bad_request("messages: the chat template did not render text", "body.messages")
    return text


def _echo_text(body: ChatCompletionRequest, role: str) -> str:
    """vLLM's `echo`: the last message's content, when it has the response's role."""
    last = body.messages[-1]
    if body.echo and last.get("role") == role and isinstance(last.get("content"), str):
        return last["content"]
    return ""


def chat_response(ctx: ChatContext, final: RequestOutput) -> ChatCompletionResponse:
    body = ctx.body
    choices = [_chat_choice(ctx, comp) for comp in final.outputs]
    num_completion = sum(len(c.token_ids) for c in final.outputs)
    cached = final.num_cached_tokens if ctx.cached_details else None
    return ChatCompletionResponse(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=make_usage(len(final.prompt_token_ids), num_completion, cached),
        prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_info(final.prompt_logprobs),
        sglext=sglext_of(body, final),
    )


def _chat_choice(ctx: ChatContext, comp: CompletionOutput) -> ChatChoice:
    parser = ctx.parser()
    parsed = parser.final(comp.text)
    message = ChatMessage(
        role=ctx.role,
        content=ctx.echo_text + parsed.content if parsed.content is not None else None,
        reasoning=parsed.reasoning,
        tool_calls=parsed.tool_calls,
    )
    return ChatChoice(
        index=comp.index,
        message=message,
        logprobs=_logprobs(ctx, comp),
        finish_reason=_finish_reason(parser, comp.finish_reason),
        stop_reason=comp.stop_reason,
        token_ids=list(comp.token_ids) if ctx.body.return_token_ids else None,
        weight_versions=weight_spans(comp.weight_versions),
        routed_experts=encode_routed_experts(comp.routed_experts),
        bf16_logprobs=comp.bf16_logprobs,
    )


def _finish_reason(parser: ChoiceParser, reason: str | None) -> str | None:
    """vLLM's: "tool_calls" when the parser found calls ("auto") or a "required" output
    completed; a named function keeps the engine's reason."""
    if not parser.calls_made or parser.forced_name is not None:
        return reason
    if parser.required and reason != "stop":
        return reason
    return "tool_calls" if reason is not None else None


def _logprobs(ctx: ChatContext, comp: CompletionOutput) -> ChatChoiceLogProbs | None:
    if not ctx.body.logprobs or comp.logprobs is None:
        return None
    as_ids = ctx.body.return_tokens_as_token_ids
    top_k = ctx.body.top_logprobs or 0
    content = []
    for token_id, entries in zip(comp.token_ids, comp.logprobs):
        sampled = entries.get(token_id)
        ranked = [(lp.rank, t, lp) for t, lp in entries.items() if lp.rank is not None]
        top = sorted(r for r in ranked if r[0] <= top_k)
        content.append(
            ChatLogProbsContent(
                **_chat_logprob(token_id, sampled, as_ids).model_dump(),
                top_logprobs=[_chat_logprob(t, lp, as_ids) for _, t, lp in top],
            )
        )
    return ChatChoiceLogProbs(content=content)


def _chat_logprob(token_id: int, logprob: Logprob | None, as_ids: bool) -> ChatLogProb:
    token = token_text(token_id, logprob, as_ids)
    value = clamp_logprob(logprob.logprob) if logprob is not None else clamp_logprob(float("-inf"))
    return ChatLogProb(token=token, logprob=value, bytes=list(token.encode("utf-8", "replace")))


async def stream_chat(ctx: ChatContext, stream: MergedStream) -> AsyncIterator[str]:
    body = ctx.body
    tracker = StreamTracker(body.n, [len(ctx.prompt.token_ids)])
    parsers = [ctx.parser() for _ in range(body.n)]
    try:
        try:
            for chunk in _opening_chunks(ctx):
                yield sse(chunk)
            async for _, output in stream.outputs():
                for index, progress, delta in tracker.updates(0, output):
                    usage = tracker.choice_usage(progress) if continuous_usage(body) else None
                    choice = _stream_choice(ctx, index, delta, parsers[index])
                    yield sse(ctx.chunk([choice], usage=usage))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse(ctx.chunk([], usage=tracker.usage(ctx.cached_details)))
        except Exception as e:  # the status line is sent: report in-band, as vLLM does
            yield sse_error(e)
        yield SSE_DONE
    finally:
        await stream.close()


def _opening_chunks(ctx: ChatContext) -> list[ChatCompletionChunk]:
    """The role of every choice first (with the prompt's token ids), then any echo."""
    ids = list(ctx.prompt.token_ids) if ctx.body.return_token_ids else None
    chunks = [
        ctx.chunk(
            [ChatStreamChoice(index=j, delta=DeltaMessage(role=ctx.role, content=""))],
            prompt_token_ids=ids if j == 0 else None,
        )
        for j in range(ctx.body.n)
    ]
    if ctx.echo_text:
        chunks += [
            ctx.chunk([ChatStreamChoice(index=j, delta=DeltaMessage(content=ctx.echo_text))])
            for j in range(ctx.body.n)
        ]
    return chunks


def _stream_choice(
    ctx: ChatContext, index: int, delta: CompletionOutput, parser: ChoiceParser
) -> ChatStreamChoice:
    return ChatStreamChoice(
        index=index,
        delta=_delta_message(parser, delta),
        logprobs=_logprobs(ctx, delta),
        finish_reason=_finish_reason(parser, delta.finish_reason),
        stop_reason=delta.stop_reason,
        token_ids=list(delta.token_ids) if ctx.body.return_token_ids else None,
        weight_versions=weight_spans(delta.weight_versions),
        bf16_logprobs=delta.bf16_logprobs,
    )


def _delta_message(parser: ChoiceParser, delta: CompletionOutput) -> DeltaMessage:
    """The text of one delta through the choice's parsers; at the choice's end, whatever
    they held back (a partial tag that turned out to be text, a forced call's array)."""
    if not parser.active:
        return DeltaMessage(content=delta.text)
    parsed = parser.feed(delta.text) if delta.text else ParsedDelta()
    if delta.finish_reason is not None:
        parsed = merge_deltas(parsed, parser.finish())
    calls = [asdict(call, dict_factory=_without_none) for call in parsed.tool_calls]
    return DeltaMessage(
        content=parsed.content if parsed.content or not calls and not parsed.reasoning else None,
        reasoning=parsed.reasoning or None,
        tool_calls=calls or None,
    )


def _without_none(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: value for key, value in items if value is not None}
