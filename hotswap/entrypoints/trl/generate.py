"""TRL's /generate/ and /chat/ mapped onto `AsyncLLM`: the sampling fields (TRL's, then
generation_kwargs over them), the prompts, and the answer in TRL's shape.

Logprobs: TRL's server runs vLLM with logprobs_mode="processed_logprobs" (after
temperature and the other processing, what TRL's importance sampling compares against);
start hotswap with --logprobs-mode processed_logprobs to match (its default is raw).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.chat import apply_template
from hotswap.entrypoints.openai.params import EnginePrompt, check_context_length, prepare_prompt
from hotswap.entrypoints.openai.protocol import normalize_messages
from hotswap.entrypoints.openai.serving import (
    MergedStream,
    clamp_logprob,
    collect_final,
    engine_ids,
)
from hotswap.entrypoints.server.default_only import check_default_only
from hotswap.entrypoints.server.errors import bad_request, validation_param
from hotswap.entrypoints.server.limits import check_request_chat_template, off_loop
from hotswap.entrypoints.server.routing import request_routing
from hotswap.entrypoints.server.sampling import build_sampling_params
from hotswap.entrypoints.trl.protocol import (
    DEFAULT_ONLY_KWARGS,
    SAMPLING_KWARGS,
    ChatRequest,
    GenerationKwargs,
    SamplingFields,
    check_text_only,
)
from hotswap.errors import InvalidArgument
from hotswap.outputs import CompletionOutput, RequestOutput
from hotswap.sampling_params import RequestOutputKind, SamplingParams


# -- sampling -------------------------------------------------------------------------------
def sampling_params(body: SamplingFields) -> SamplingParams:
    """TRL's fields, then generation_kwargs over them (as TRL merges them); a value
    hotswap cannot honour is a 400 naming it, never ignored."""
    for name in ("structured_outputs_regex", "guided_decoding_regex"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name}: structured outputs are not supported", f"body.{name}")
    given: dict[str, Any] = {"max_tokens": body.max_tokens, "logprobs": body.logprobs}
    # generation_kwargs override as given (a "stop" of "" too), as TRL hands them to vLLM
    overrides = _generation_overrides(body.generation_kwargs or {})
    given.update(overrides)
    try:
        return build_sampling_params(body, **given, output_kind=RequestOutputKind.FINAL_ONLY)
    except InvalidArgument as e:
        field = e.field
        if field in overrides:
            raise bad_request(f"generation_kwargs.{e}", f"body.generation_kwargs.{field}") from None
        raise bad_request(str(e), f"body.{field}" if field else None) from None


def _generation_overrides(generation_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generation_kwargs that override TRL's fields, typed and bounded; a field at
    its vLLM default only is dropped, any other value of it (or an unknown field) is 400."""
    given = {}
    for key, value in generation_kwargs.items():
        where = f"body.generation_kwargs.{key}"
        if key in SAMPLING_KWARGS:
            given[key] = value
        elif key in DEFAULT_ONLY_KWARGS.fields:
            check_default_only(DEFAULT_ONLY_KWARGS, {key: value}, "body.generation_kwargs")
        else:
            raise bad_request(f"generation_kwargs.{key}: not a sampling parameter this "
                              f"server supports", where)  # fmt: skip
    try:
        kwargs = GenerationKwargs.model_validate(given)
    except ValidationError as e:
        first = e.errors()[0]
        where = validation_param(("generation_kwargs", *first.get("loc", ())))
        raise bad_request(
            f"{where}: {first.get('msg', 'invalid value')}", f"body.{where}"
        ) from None
    return {key: getattr(kwargs, key) for key in given}


def truncation(engine: AsyncLLM, value: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last k tokens; -1: the context length."""
    if value is None:
        return None
    if value == -1:
        return engine.config.scheduler.max_model_len
    if value < 1:
        raise bad_request(f"truncate_prompt_tokens: must be -1 or >= 1, got {value}",
                          "body.truncate_prompt_tokens")  # fmt: skip
    return value


# -- prompts --------------------------------------------------------------------------------
async def generate_prompts(
    engine: AsyncLLM, prompts: list[str] | list[list[int]], truncate: int | None
) -> list[EnginePrompt]:
    """/generate/'s prompts (texts or token id lists), each tokenized and checked."""
    prepared = []
    for i, prompt in enumerate(prompts):
        param = f"body.prompts[{i}]"
        prepared.append(
            await off_loop(prepare_prompt, engine, prompt, truncate=truncate, param=param)
        )
    return prepared


@dataclass(frozen=True)
class ChatTemplateOptions:
    """chat_template_kwargs split into what `apply_template` takes by name and the rest
    (the tools included), which goes to the template as variables."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    template_kwargs: dict[str, Any]


def chat_template_options(request: Request, body: ChatRequest) -> ChatTemplateOptions:
    """vLLM's `LLM.chat` defaults (a generation prompt added), unless chat_template_kwargs
    says otherwise; a request's own template only if the server trusts its callers."""
    kwargs = dict(body.chat_template_kwargs or {})
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    continue_final_message = kwargs.pop("continue_final_message", False)
    template = kwargs.pop("chat_template", None)
    check_request_chat_template(request, template, "body.chat_template_kwargs.chat_template")
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{name}: must be a boolean",
                              f"body.chat_template_kwargs.{name}")  # fmt: skip
    if body.tools is not None:
        kwargs["tools"] = body.tools
    return ChatTemplateOptions(add_generation_prompt, continue_final_message, template, kwargs)


async def chat_prompt(
    engine: AsyncLLM,
    messages: list[dict[str, Any]],
    index: int,
    options: ChatTemplateOptions,
    truncate: int | None,
) -> EnginePrompt:
    """Conversation `index` through the chat template, tokenized without special tokens
    (the template holds them), as vLLM's `LLM.chat`."""
    check_text_only(messages, index)
    try:  # text parts joined, as vLLM and the OpenAI route do
        messages = normalize_messages(messages)
    except ValueError as e:
        raise bad_request(f"messages[{index}]: {e}", f"body.messages[{index}]") from None
    text = await off_loop(
        apply_template,
        engine,
        messages,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        chat_template=options.chat_template,
        template_kwargs=options.template_kwargs,
    )
    return await off_loop(
        prepare_prompt,
        engine,
        text,
        add_special_tokens=False,
        truncate=truncate,
        param=f"body.messages[{index}]",
    )


# -- the answer -----------------------------------------------------------------------------
async def generate_completions(
    request: Request, engine: AsyncLLM, prompts: list[EnginePrompt], params: SamplingParams
) -> dict[str, Any]:
    """Every prompt's n completions, in TRL's answer: prompt_ids per prompt, then
    completion_ids (and logprobs) prompt by prompt, n each, in sample order."""
    for prompt in prompts:
        check_context_length(engine, prompt, params.max_tokens, "body.max_tokens")
        prompt.routing = request_routing(request)  # X-Session-ID, X-data-parallel-rank
    finals: list[RequestOutput] = []
    if prompts:
        ids = engine_ids(f"trl-{uuid.uuid4().hex}", len(prompts))
        stream = MergedStream(engine, prompts, params, ids)
        await stream.start()
        finals = await collect_final(request, stream)
    completions = [c for out in finals for c in sorted(out.outputs, key=lambda c: c.index)]
    logprobs, token_ids = _trl_logprobs(completions, params.logprobs is not None)
    return {
        "prompt_ids": [list(out.prompt_token_ids) for out in finals],
        "completion_ids": [list(c.token_ids) for c in completions],
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
    }


def _trl_logprobs(
    completions: list[CompletionOutput], wanted: bool
) -> tuple[list | None, list | None]:
    """TRL's shape (its `extract_logprobs`): per completion, per token, the sampled token
    and the top-k by rank; NaN as null, -inf clamped as on the OpenAI routes."""
    if not wanted or any(c.logprobs is None for c in completions):
        return None, None
    values, ids = [], []
    for comp in completions:
        seq_values, seq_ids = [], []
        for entry in comp.logprobs or []:
            ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
            seq_ids.append([token for token, _ in ranked])
            seq_values.append(
                [None if math.isnan(lp.logprob) else clamp_logprob(lp.logprob) for _, lp in ranked]
            )
        values.append(seq_values)
        ids.append(seq_ids)
    return values, ids
