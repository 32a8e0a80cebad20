"""POST /v1/chat/completions/render (vLLM's): what a chat request becomes before it runs:
its exact token ids (image placeholders expanded), where each image sits and its content
hash, and the sampling parameters; nothing is generated. A trainer checks its own
preprocessing against it, then sends `token_ids` (and the images as `content_parts`) to
/inference/v1/generate."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request

from hotswap.entrypoints.openai.chat import render_chat
from hotswap.entrypoints.openai.chat_tools import forced_call_constraint
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
    sampling_params,
)
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest
from hotswap.entrypoints.server.limits import check_request_chat_template, off_loop
from hotswap.entrypoints.server.state import get_engine


async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
    """vLLM's GenerateRequest for the chat request (its `features` without the serialized
    tensors: hotswap's /inference/v1/generate takes images as `content_parts`)."""
    engine = get_engine(request)
    lora = check_model(request, body.model)
    check_unsupported(body)
    apply_server_flags(request, body)
    check_request_chat_template(request, body.chat_template, "body.chat_template")
    max_tokens = completion_max_tokens(body)
    sampling = sampling_params(
        body, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream, structured_outputs=forced_call_constraint(body),
        defaults=engine.config.default_sampling,
    )  # fmt: skip
    prompt = await off_loop(render_chat, engine, body)
    check_context_length(engine, prompt, max_tokens, max_tokens_param(body))
    return {
        "request_id": base_request_id(request, body.request_id, "chatcmpl"),
        "token_ids": prompt.token_ids,
        "features": features(prompt),
        "sampling_params": msgspec.to_builtins(sampling),
        "model": model_name(request, lora),
        "stream": bool(body.stream),
        "cache_salt": body.cache_salt,
        "priority": body.priority,
    }


def features(prompt: EnginePrompt) -> dict[str, Any] | None:
    """vLLM's MultiModalFeatures: each image's content hash and placeholder range."""
    if not prompt.images or not prompt.placeholders:
        return None
    ranges = [{"offset": offset, "length": length} for offset, length in prompt.placeholders]
    return {
        "mm_hashes": {"image": [image.content_hash for image in prompt.images]},
        "mm_placeholders": {"image": ranges},
        "kwargs_data": None,
    }
