"""POST /tokenize and /detokenize (vLLM's shapes) and GET /v1/models."""

from __future__ import annotations

import time

from fastapi import Request

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.chat import apply_template, chat_images
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    check_model,
    place_images,
    served_model_name,
)
from hotswap.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from hotswap.entrypoints.openai.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.limits import check_request_chat_template, off_loop
from hotswap.entrypoints.server.state import get_engine


def list_models(request: Request) -> ModelList:
    """The served model, then each loaded LoRA adapter as vLLM lists one: its name as
    `id`, its directory as `root`, the served model as `parent`."""
    engine = get_engine(request)
    served, created = served_model_name(request), int(time.time())
    card = ModelCard(
        id=served,
        created=created,
        root=str(engine.config.model.path),
        max_model_len=engine.config.scheduler.max_model_len,
    )
    adapters = [
        ModelCard(id=name, created=created, root=path, parent=served)
        for name, path in engine.loaded_adapters.items()
    ]
    return ModelList(data=[card, *adapters])


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    check_model(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt: give exactly one of 'prompt' or 'messages'", "body.prompt")
    check_request_chat_template(request, body.chat_template, "body.chat_template")
    return await off_loop(_tokenize, body, get_engine(request))


def _tokenize(body: TokenizeRequest, engine: AsyncLLM) -> TokenizeResponse:
    if body.messages is not None:
        text = apply_template(
            engine,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            documents=body.documents,
            tools=body.tools or None,
            template_kwargs=body.chat_template_kwargs,
        )
        add_special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special = body.add_special_tokens is not False
    ids = engine.tokenizer.encode(text, add_special_tokens=add_special)
    sources = chat_images(body.messages or [])
    if sources:  # as vLLM: each image's placeholder expanded to its tokens
        prompt = place_images(engine, EnginePrompt(text, ids), sources, "messages")
        ids = prompt.token_ids
    return TokenizeResponse(
        count=len(ids),
        max_model_len=engine.config.scheduler.max_model_len,
        tokens=ids,
        token_strs=engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    )


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = get_engine(request)
    check_model(request, body.model)
    vocab = engine.config.model.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens: token id {bad} is outside the vocabulary (integers 0..{vocab - 1})",
            "body.tokens",
        )
    return DetokenizeResponse(prompt=await off_loop(engine.tokenizer.decode, body.tokens))
