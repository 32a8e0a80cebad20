"""The routes of the OpenAI-compatible API; `server/app.py` `build_app` includes `openai_router`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from hotswap.entrypoints.openai.chat import create_chat_completion
from hotswap.entrypoints.openai.completions import create_completion
from hotswap.entrypoints.openai.generate_protocol import GenerateRequest
from hotswap.entrypoints.openai.generate_tokens import create_generate
from hotswap.entrypoints.openai.params import UnknownFieldsRoute
from hotswap.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hotswap.entrypoints.openai.render import render_chat_completion
from hotswap.entrypoints.openai.responses import DetokenizeResponse, ModelList, TokenizeResponse
from hotswap.entrypoints.openai.tokenization import detokenize, list_models, tokenize

openai_router = APIRouter(route_class=UnknownFieldsRoute)  # unknown fields: warned or refused


@openai_router.get("/v1/models")
async def models(request: Request) -> ModelList:
    return list_models(request)


@openai_router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(body, request)


@openai_router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(body, request)


@openai_router.post("/v1/chat/completions/render")
async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> dict:
    """vLLM's render route: the request's token ids and image placements, not run."""
    return await render_chat_completion(body, request)


@openai_router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return await tokenize(body, request)


@openai_router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return await detokenize(body, request)


@openai_router.post("/inference/v1/generate")
async def generate_tokens(body: GenerateRequest, request: Request) -> Response:
    """vLLM 0.32's token-in/token-out route (generate_tokens)."""
    return await create_generate(body, request)
