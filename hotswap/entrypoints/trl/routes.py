"""TRL's `trl vllm-serve` dialect: the routes TRL's `VLLMClient` calls, trailing slash
included (a route without it would answer TRL with a 307), over `AsyncLLM` and the
control verbs.

What TRL sends (huggingface/trl: trl/generation/vllm_client.py `VLLMClient`, answered by
trl/scripts/vllm_serve.py):
- GET /health/ (`check_server`): 200 is all it reads; TRL answers {"status": "ok"}.
- POST /generate/ {prompts (texts or token id lists), images (null), n,
  repetition_penalty, temperature, top_p, top_k (0), min_p, max_tokens, logprobs (0),
  structured_outputs_regex (null), generation_kwargs ({})} and /chat/ (the same with
  messages, chat_template_kwargs, tools); it reads prompt_ids (one per prompt),
  completion_ids (prompt by prompt, n each), logprobs and logprob_token_ids (per token
  the sampled token and the top-k, by rank; both null when logprobs is null).
- `init_communicator(device)`: GET /get_world_size/ -> {"world_size": W} (the engine's
  workers); POST /init_communicator/ {"host": "0.0.0.0", "port": group_port,
  "world_size": W + 1, "client_device_uuid": ...}, answered before any group forms; then
  the client joins as rank W, the LAST (vLLM's StatelessProcessGroup + PyNcclCommunicator;
  rank 0, a server worker, hosts the store at the address the client reached the server
  on).
- `update_named_param(name, tensor)`: POST /update_named_param/ {"name", "dtype":
  "torch.float32", "shape": [...]}, answered at once; then the client broadcasts the
  tensor from its rank (and barriers). `update_model_params` does this per parameter;
  TRL has no batched route (none in its history). After a sync: POST /reset_prefix_cache/.
- POST /close_communicator/ (also at exit).

The weight plane's round semantics are in trl_weights.py, the generation mapping and
its logprobs in trl_generate.py, the request bodies in trl_protocol.py.

/health/, /generate/ and /chat/ are data routes, always served; the others change or
describe the weight plane and are served only with --enable-control (404 otherwise, as an
absent route).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.exceptions import HTTPException

from hotswap.engine import verbs
from hotswap.entrypoints.openai.params import UnknownFieldsRoute
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.state import get_engine, get_server_config
from hotswap.entrypoints.server.verb_routes import VerbRoute, add_verb_routes
from hotswap.entrypoints.trl.generate import (
    chat_prompt,
    chat_template_options,
    generate_completions,
    generate_prompts,
    sampling_params,
    truncation,
)
from hotswap.entrypoints.trl.protocol import (
    ChatRequest,
    GenerateRequest,
    InitCommunicatorRequest,
    UpdateNamedParamRequest,
    check_no_images,
    param_meta,
)
from hotswap.entrypoints.trl.weights import (
    cancel_init,
    check_against_model,
    check_transfer_config,
    check_world_size,
    drop_communicator,
    group_init_info,
    leave_group,
    raise_deferred_failure,
    settle,
    start_init,
    start_param_round,
    trl_session,
)

HEALTH_TIMEOUT_S = 10.0  # as /health


def _require_control(request: Request) -> None:
    """Weight-plane routes exist only with --enable-control: else 404, as if absent."""
    if not get_server_config(request).enable_control:
        raise HTTPException(404, "Not Found")


# unknown body fields: warned about or refused (UnknownFieldsRoute), as on the OpenAI routes
trl_router = APIRouter(route_class=UnknownFieldsRoute)
_control = APIRouter(route_class=UnknownFieldsRoute, dependencies=[Depends(_require_control)])

GET_WORLD_SIZE = VerbRoute(
    "/get_world_size/",
    verbs.GetWorldSize,
    "GET",
    source="query",
    answer=lambda d: {"world_size": d.result},
)
add_verb_routes(_control, [GET_WORLD_SIZE])


# -- data routes ----------------------------------------------------------------------------
@trl_router.get("/health/")
async def health(request: Request) -> dict[str, str]:
    """TRL's answer; 503 when the engine core does not answer (as /health)."""
    try:
        await asyncio.wait_for(get_engine(request).is_paused(), HEALTH_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
        raise APIError(503, f"engine is not available: {type(e).__name__}: {e}") from None
    return {"status": "ok"}


@trl_router.post("/generate/")
async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    engine = get_engine(request)
    check_no_images(body)
    params = sampling_params(body)
    truncate = truncation(engine, body.truncate_prompt_tokens)
    prompts = await generate_prompts(engine, body.prompts, truncate)
    return await generate_completions(request, engine, prompts, params)


@trl_router.post("/chat/")
async def chat(body: ChatRequest, request: Request) -> dict[str, Any]:
    """vLLM's `LLM.chat`: each conversation through the chat template (a generation prompt
    added; chat_template_kwargs may say otherwise), tokenized without special tokens."""
    engine = get_engine(request)
    params = sampling_params(body)
    truncate = truncation(engine, body.truncate_prompt_tokens)
    options = chat_template_options(request, body)
    prompts = []
    for i, messages in enumerate(body.messages):
        prompts.append(await chat_prompt(engine, messages, i, options, truncate))
    return await generate_completions(request, engine, prompts, params)


# -- the weight plane (control-gated) -------------------------------------------------------
@_control.post("/init_communicator/")
async def init_communicator(body: InitCommunicatorRequest, request: Request) -> dict[str, str]:
    """Join the trainer's group with the trainer as the last rank: answered once the
    engine is waiting for it (TRL joins after the answer)."""
    engine = get_engine(request)
    check_transfer_config(request)
    if not 1 <= body.port <= 65535:
        raise bad_request(f"port: must be in [1, 65535], got {body.port}", "body.port")
    session = trl_session(request)
    async with session.lock:
        await drop_communicator(session, engine)  # a new communicator replaces the old one
        await check_world_size(engine, body.world_size)
        init_info = group_init_info(request, body.host, body.port, body.world_size)
        await start_init(request, session, init_info)
    return {"message": "Request received, initializing communicator"}


@_control.post("/update_named_param/")
async def update_named_param(body: UpdateNamedParamRequest, request: Request) -> dict[str, str]:
    """One parameter, one round: checked and opened before the answer; the trainer then
    broadcasts it, and it is received and committed behind the answer."""
    meta = param_meta(body)
    engine = get_engine(request)
    session = trl_session(request)
    async with session.lock:
        await raise_deferred_failure(session)
        if not session.is_joined:
            raise APIError(409, "update_named_param: no communicator; call /init_communicator/ "
                                "first")  # fmt: skip
        await check_against_model(session, engine, meta)
        await start_param_round(request, session, meta)
    return {"message": "Request received, updating named parameter"}


@_control.post("/reset_prefix_cache/")
async def reset_prefix_cache(request: Request) -> dict[str, str]:
    """After a sync: waits for the last parameter's commit (reporting its failure)."""
    session = trl_session(request)
    async with session.lock:
        await raise_deferred_failure(session)
        await get_engine(request).reset_prefix_cache()
    return {"message": "Request received, resetting prefix cache status: True"}


@_control.post("/close_communicator/")
async def close_communicator(request: Request) -> dict[str, str]:
    """Waits for the last parameter's commit (reporting its failure, still closing),
    cancels an init still waiting for its trainer, and leaves the group (its port is free
    for the trainer's next init)."""
    engine = get_engine(request)
    session = trl_session(request)
    async with session.lock:
        await cancel_init(session, engine)
        joining = session.pending is not None and session.pending.is_init
        failure = await settle(session)
        if session.is_joined:
            await leave_group(engine)
        session.close()
        if failure is not None and not joining:  # an init's failure: nothing was lost
            raise failure
    return {"message": "Request received, closing communicator"}


trl_router.include_router(_control)
