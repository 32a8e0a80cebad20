"""POST /v1/chat/completions/render (vLLM's): what a chat request becomes before it runs:
its exact token ids (image placeholders expanded), where each image sits and its content
hash, and the sampling parameters; nothing is generated. A trainer checks its own
preprocessing against it, then sends `token_ids` (and the images as `content_parts`) to
/inference/v1/generate."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request

from hotswap.entrypoints.openai.chat import prepare_chat
from hotswap.entrypoints.openai.params import EnginePrompt, base_request_id, model_name
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest


async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
    """vLLM's GenerateRequest for the chat request (its `features` without the serialized
    tensors: hotswap's /inference/v1/generate takes images as `content_parts`)."""
    lora, sampling, prompt = await prepare_chat(body, request)
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
