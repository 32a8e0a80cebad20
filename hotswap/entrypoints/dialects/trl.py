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

Round semantics: each /update_named_param/ is one round of one tensor. The route validates
the parameter (format, then name, shape and dtype kind against the model) and opens the
round before it answers, so a bad parameter is a 400 naming the field while the trainer
has not sent anything; the receive and the commit then run behind the answer (the trainer
only broadcasts once answered). Every commit applies that one tensor and bumps the weight
version (label unchanged): /weight_info counts one version per parameter, as vLLM applies
each parameter at once. The next TRL call waits for that commit; a failure behind an answer
(a transport error, the trainer gone) is that next call's answer (400/409, never a 5xx
TRL's client would retry into success). Under `require_complete` a one-tensor round cannot
commit: /init_communicator/ is then refused.

On CPU, TRL's client cannot run (PyNccl is CUDA-only): hotswap.weight_transfer.trl_client
mirrors it over gloo with the same routes and layout. TRL's own client on GPU needs the
engine to speak vLLM's StatelessProcessGroup/PyNccl rendezvous, which torch's NCCL process
groups (hotswap's nccl backend) do not: its /init_communicator/ is accepted, its group
would not form.

Logprobs: TRL's server runs vLLM with logprobs_mode="processed_logprobs" (after
temperature and the other processing, what TRL's importance sampling compares against);
start hotswap with --logprobs-mode processed_logprobs to match (its default is raw).

/health/, /generate/ and /chat/ are data routes, always served; the others change or
describe the weight plane and are served only with --enable-control (404 otherwise, as an
absent route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.errors import EngineDeadError, EngineStateError
from hotswap.entrypoints.errors import APIError, bad_request, param_of, validation_param
from hotswap.entrypoints.limits import check_request_chat_template, off_loop
from hotswap.entrypoints.openai.chat import apply_template
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    check_context_length,
    check_unknown_fields,
    prepare_prompt,
)
from hotswap.entrypoints.openai.protocol import (
    I64,
    MAX_LOGPROBS,
    MAX_N,
    NonNegInt64,
    RequestModel,
    normalize_messages,
)
from hotswap.entrypoints.openai.serving import (
    MergedStream,
    clamp_logprob,
    collect_final,
    engine_ids,
)
from hotswap.entrypoints.state import get_engine, get_server_config
from hotswap.entrypoints.verb_routes import (
    VerbRoute,
    add_verb_routes,
    call_route,
    call_verb,
    route_args,
)
from hotswap.errors import InvalidArgument
from hotswap.outputs import CompletionOutput, RequestOutput
from hotswap.sampling_params import RequestOutputKind, SamplingParams
from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info, parse_dtype_name

logger = logging.getLogger(__name__)

BROADCAST_BACKENDS = ("gloo", "nccl")
# How long /init_communicator/ waits for the engine to refuse the group at once (a port in
# use, an address not allowed) before answering; after that it waits for the trainer.
QUICK_REFUSAL_S = 0.3
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
HEALTH_TIMEOUT_S = 10.0  # as /health


# -- requests -------------------------------------------------------------------------------
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _Sampling(RequestModel):
    """The sampling fields /generate/ and /chat/ share (TRL's defaults; the OpenAI
    routes' bounds, value checks left to SamplingParams)."""

    n: Annotated[int, Field(le=MAX_N)] = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: TopK = -1
    min_p: float = 0.0
    max_tokens: NonNegInt64 = 16
    logprobs: Logprobs | None = 0
    structured_outputs_regex: str | None = None
    guided_decoding_regex: str | None = None  # its name before TRL 0.27 (vLLM 0.12 support)
    truncate_prompt_tokens: int | None = None  # sent until TRL's vLLM 0.17 support
    generation_kwargs: dict[str, Any] | None = Field(default_factory=dict)


class GenerateRequest(_Sampling):
    prompts: list[str] | list[list[int]]
    images: list[Any] | None = None


class ChatRequest(_Sampling):
    messages: list[list[dict[str, Any]]]
    chat_template_kwargs: dict[str, Any] | None = Field(default_factory=dict)
    tools: list[Any] | None = None


class InitCommunicatorRequest(RequestModel):
    host: str
    port: int
    world_size: int
    client_device_uuid: str


class UpdateNamedParamRequest(RequestModel):
    name: str
    dtype: str
    shape: list[int]


class GenerationKwargs(BaseModel):
    """The generation_kwargs (vLLM SamplingParams fields) hotswap honours, typed and
    bounded as on the OpenAI routes; those given override TRL's fields."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: TopK = 0
    min_p: float = 0.0
    seed: Annotated[int, Field(ge=-I64, lt=2**64)] | None = None
    max_tokens: NonNegInt64 | None = 16
    min_tokens: NonNegInt64 = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt64] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Logprobs | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    max_weight_lag: NonNegInt64 | None = None


SAMPLING_KWARGS = frozenset(GenerationKwargs.model_fields)
# The vLLM fields hotswap accepts only at vLLM's default (anything else is refused, never ignored).
DEFAULT_ONLY_KWARGS: dict[str, Any] = {
    "best_of": None,
    "detokenize": True,
    "logits_processors": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logit_bias": None,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "structured_outputs": None,
    "guided_decoding": None,
    "extra_args": None,
    "flat_logprobs": False,
}


# -- routers --------------------------------------------------------------------------------
def _require_control(request: Request) -> None:
    """Weight-plane routes exist only with --enable-control: else 404, as if absent."""
    if not get_server_config(request).enable_control:
        raise HTTPException(404, "Not Found")


trl_router = APIRouter()
_control = APIRouter(dependencies=[Depends(_require_control)])

GET_WORLD_SIZE = VerbRoute(
    "/get_world_size/",
    "get_world_size",
    "GET",
    source="query",
    answer=lambda d: {"world_size": d.result},
)
INIT = VerbRoute("/init_communicator/", "init_weight_transfer_engine")
UPDATE = VerbRoute("/update_named_param/", "update_weights")
add_verb_routes(_control, [GET_WORLD_SIZE])


@trl_router.get("/health/")
async def health(request: Request) -> dict[str, str]:
    """TRL's answer; 503 when the engine core does not answer (as /health)."""
    try:
        await asyncio.wait_for(get_engine(request).is_paused(), HEALTH_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
        raise APIError(503, f"engine is not available: {type(e).__name__}: {e}") from None
    return {"status": "ok"}


# -- generation -----------------------------------------------------------------------------
@trl_router.post("/generate/")
async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    check_unknown_fields(request, body)
    engine = get_engine(request)
    for i, images in enumerate(body.images or []):
        if images is not None:
            raise bad_request(f"images[{i}]: this server has no image input", f"body.images[{i}]")
    params = _sampling_params(body)
    truncate = _truncation(engine, body.truncate_prompt_tokens)
    prompts = []
    for i, prompt in enumerate(body.prompts):
        param = f"body.prompts[{i}]"
        prompts.append(
            await off_loop(prepare_prompt, engine, prompt, truncate=truncate, param=param)
        )
    return await _run(request, engine, prompts, params)


@trl_router.post("/chat/")
async def chat(body: ChatRequest, request: Request) -> dict[str, Any]:
    """vLLM's `LLM.chat`: each conversation through the chat template (a generation prompt
    added; chat_template_kwargs may say otherwise), tokenized without special tokens."""
    check_unknown_fields(request, body)
    engine = get_engine(request)
    params = _sampling_params(body)
    truncate = _truncation(engine, body.truncate_prompt_tokens)
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
    prompts = []
    for i, messages in enumerate(body.messages):
        _check_text_only(messages, i)
        try:  # text parts joined, as vLLM and the OpenAI route do
            messages = normalize_messages(messages)
        except ValueError as e:
            raise bad_request(f"messages[{i}]: {e}", f"body.messages[{i}]") from None
        text = await off_loop(
            apply_template,
            engine,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            template_kwargs=kwargs,
        )
        prompts.append(
            await off_loop(
                prepare_prompt,
                engine,
                text,
                add_special_tokens=False,
                truncate=truncate,
                param=f"body.messages[{i}]",
            )
        )
    return await _run(request, engine, prompts, params)


def _check_text_only(messages: list[dict[str, Any]], index: int) -> None:
    for j, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                where = f"messages[{index}][{j}].content[{k}]"
                raise bad_request(f"{where}: only text parts are served, got {kind!r}",
                                  f"body.{where}")  # fmt: skip


def _sampling_params(body: _Sampling) -> SamplingParams:
    """TRL's fields, then generation_kwargs over them (as TRL merges them); a value
    hotswap cannot honour is a 400 naming it, never ignored."""
    for name in ("structured_outputs_regex", "guided_decoding_regex"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name}: structured outputs are not supported", f"body.{name}")
    values: dict[str, Any] = {
        "n": body.n,
        "repetition_penalty": body.repetition_penalty,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "max_tokens": body.max_tokens,
        "logprobs": body.logprobs,
    }
    given = {}
    for key, value in (body.generation_kwargs or {}).items():
        where = f"body.generation_kwargs.{key}"
        if key in SAMPLING_KWARGS:
            given[key] = value
        elif key in DEFAULT_ONLY_KWARGS:
            if value != DEFAULT_ONLY_KWARGS[key]:
                raise bad_request(f"generation_kwargs.{key}: not supported (only "
                                  f"{DEFAULT_ONLY_KWARGS[key]!r})", where)  # fmt: skip
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
    values.update({key: getattr(kwargs, key) for key in given})
    try:
        return SamplingParams(**values, output_kind=RequestOutputKind.FINAL_ONLY)
    except (ValueError, TypeError) as e:
        field = param_of(str(e))
        if field in given:
            raise bad_request(f"generation_kwargs.{e}", f"body.generation_kwargs.{field}") from None
        raise bad_request(str(e), f"body.{field}" if field else None) from None


def _truncation(engine: AsyncLLM, value: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last k tokens; -1: the context length."""
    if value is None:
        return None
    if value == -1:
        return engine.config.scheduler.max_model_len
    if value < 1:
        raise bad_request(f"truncate_prompt_tokens: must be -1 or >= 1, got {value}",
                          "body.truncate_prompt_tokens")  # fmt: skip
    return value


async def _run(
    request: Request, engine: AsyncLLM, prompts: list[EnginePrompt], params: SamplingParams
) -> dict[str, Any]:
    for prompt in prompts:
        check_context_length(engine, prompt, params.max_tokens, "body.max_tokens")
    finals: list[RequestOutput] = []
    if prompts:
        ids = engine_ids(f"trl-{uuid.uuid4().hex}", len(prompts))
        stream = MergedStream(engine, prompts, params, ids)
        await stream.start()
        finals = await collect_final(request, stream)
    completions = [c for out in finals for c in sorted(out.outputs, key=lambda c: c.index)]
    logprobs, token_ids = _logprobs(completions, params.logprobs is not None)
    return {
        "prompt_ids": [list(out.prompt_token_ids) for out in finals],
        "completion_ids": [list(c.token_ids) for c in completions],
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
    }


def _logprobs(completions: list[CompletionOutput], wanted: bool) -> tuple[list | None, list | None]:
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


# -- the weight plane -----------------------------------------------------------------------
@dataclass
class _Pending:
    """Work running behind an answer: an init waiting for the trainer, or one parameter's
    receive and commit."""

    task: asyncio.Task[Any]
    what: str
    is_init: bool


class _Session:
    """The TRL weight plane of one app: one call at a time, in arrival order."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.pending: _Pending | None = None
        self.open = False  # a communicator was set up (and not closed or broken since)
        self.model: torch.nn.Module | None = None  # on the meta device: names and shapes


def _session(request: Request) -> _Session:
    state = request.app.state
    session = getattr(state, "trl_session", None)
    if session is None:
        session = state.trl_session = _Session()
    return session


def _logged(task: asyncio.Task[Any], what: str) -> None:
    """Failures behind an answer are logged when they happen (and answered later)."""

    def done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("TRL %s failed after it was answered: %s", what, task.exception())

    task.add_done_callback(done)


async def _settle(session: _Session) -> APIError | None:
    """Wait for the work behind the last answer; its failure, as the error to answer now."""
    pending, session.pending = session.pending, None
    if pending is None:
        return None
    try:
        await pending.task
    except Exception as e:  # noqa: BLE001 - reported to the next call
        refused = isinstance(e, APIError) and e.status == 400 and not pending.is_init
        if not refused:  # the channel is gone (a refused parameter leaves it in step)
            session.open = False
        return _deferred(pending.what, e)
    return None


def _deferred(what: str, error: Exception) -> APIError:
    """A failure behind an earlier answer, as this call's error: 400 or 409 (TRL's client
    retries 500/502/503, and a retry would pass: the failure is reported once), 503 only
    for a dead engine (that stays dead)."""
    prefix = f"{what} failed after it was answered"
    if isinstance(error, APIError):
        status = error.status if error.status in (400, 409) else 409
        return APIError(status, f"{prefix}: {error.message}")
    if isinstance(error, EngineDeadError):
        return APIError(503, f"{prefix}: engine is not available: {error}")
    return APIError(409, f"{prefix}: {type(error).__name__}: {error}")


async def _cancel_init(session: _Session, engine: AsyncLLM) -> None:
    """An init still waiting for its trainer is cancelled (the abort answers it at once)."""
    pending = session.pending
    if pending is not None and pending.is_init and not pending.task.done():
        with contextlib.suppress(Exception):
            await engine.call("finish_weight_update", abort=True)


def _check_transfer_config(engine: AsyncLLM) -> None:
    config = engine.config.weight_transfer
    if config is None:
        raise APIError(
            409,
            "weight transfer is not configured: start the server with "
            '--weight-transfer-config \'{"backend": "gloo"}\' (or nccl)',
        )
    if config.backend not in BROADCAST_BACKENDS:
        raise APIError(
            409,
            f"TRL's communicator is a broadcast group: the server's weight transfer backend "
            f"is {config.backend!r}, not gloo or nccl",
        )
    if config.require_complete:
        raise APIError(
            409,
            "TRL sends one parameter per call, each its own round: the server's "
            "require_complete refuses such rounds",
        )


def _store_address(host: str, request: Request) -> str:
    """Where the engine's rank 0 hosts the store. TRL sends "0.0.0.0" (every interface)
    and connects to the address it reached this server on: listen on that one only."""
    if host not in WILDCARD_HOSTS:
        return host
    server = request.scope.get("server")
    return server[0] if server else get_server_config(request).host


# The engine's init refusals in TRL's wire names.
INIT_FIELDS = {
    "body.init_info.master_address": ("init_info.master_address", "host"),
    "body.init_info.master_port": ("init_info.master_port", "port"),
    "body.init_info.world_size": ("init_info.world_size", "world_size"),
}


def _init_refusal(error: APIError) -> APIError:
    if error.param not in INIT_FIELDS:
        return error
    engine_name, wire = INIT_FIELDS[error.param]
    message = error.message.replace(engine_name, wire, 1)
    return APIError(error.status, message, f"body.{wire}")


@_control.post("/init_communicator/")
async def init_communicator(body: InitCommunicatorRequest, request: Request) -> dict[str, str]:
    """Join the trainer's group with the trainer as the last rank: answered once the
    engine is waiting for it (TRL joins after the answer)."""
    check_unknown_fields(request, body)
    engine = get_engine(request)
    _check_transfer_config(engine)
    if not 1 <= body.port <= 65535:
        raise bad_request(f"port: must be in [1, 65535], got {body.port}", "body.port")
    session = _session(request)
    async with session.lock:
        await _cancel_init(session, engine)
        earlier = await _settle(session)  # a new communicator replaces the old one
        if earlier is not None:
            logger.warning("TRL /init_communicator/ replaces a failed one: %s", earlier.message)
        if session.open:  # never closed (a trainer that died): free its port first
            await _leave_group(engine)
        session.open = False
        workers = await engine.call("get_world_size")
        if body.world_size != workers + 1:
            raise bad_request(f"world_size: must be {workers + 1} (this server's {workers} "
                              f"worker(s) and the trainer), got {body.world_size}",
                              "body.world_size")  # fmt: skip
        init_info = {
            "master_address": _store_address(body.host, request),
            "master_port": body.port,
            "world_size": body.world_size,
            "rank_offset": 0,
            "trainer_rank": body.world_size - 1,
            "packed": False,  # TRL broadcasts each tensor as it is
        }
        args = route_args(INIT, {"init_info": init_info})
        task = asyncio.create_task(call_route(request, INIT, args))
        done, _ = await asyncio.wait({task}, timeout=QUICK_REFUSAL_S)
        if done:
            try:
                task.result()
            except APIError as e:
                raise _init_refusal(e) from None
        else:
            _logged(task, "init_communicator")
            session.pending = _Pending(task, "init_communicator", is_init=True)
        session.open = True
    return {"message": "Request received, initializing communicator"}


@_control.post("/update_named_param/")
async def update_named_param(body: UpdateNamedParamRequest, request: Request) -> dict[str, str]:
    """One parameter, one round: checked and opened before the answer; the trainer then
    broadcasts it, and it is received and committed behind the answer."""
    check_unknown_fields(request, body)
    meta = _param_meta(body)
    engine = get_engine(request)
    session = _session(request)
    async with session.lock:
        failure = await _settle(session)
        if failure is not None:
            raise failure
        if not session.open:
            raise APIError(409, "update_named_param: no communicator; call /init_communicator/ "
                                "first")  # fmt: skip
        await _check_against_model(session, engine, meta)
        await call_verb(request, UPDATE, "start_weight_update", is_checkpoint_format=True)
        what = f"update_named_param {meta.name!r}"
        task = asyncio.create_task(_receive_and_commit(request, metas_to_update_info([meta])))
        _logged(task, what)
        session.pending = _Pending(task, what, is_init=False)
        await asyncio.sleep(0)  # the receive is submitted (behind the start) before we answer
    return {"message": "Request received, updating named parameter"}


async def _receive_and_commit(request: Request, update_info: dict[str, Any]) -> Any:
    """The rest of a one-tensor round (as `weight_round`, whose start ran before the
    answer): receive, commit; any failure aborts the round (the old weights keep
    serving)."""
    try:
        await call_verb(request, UPDATE, "update_weights", update_info=update_info)
        return await call_verb(request, UPDATE, "finish_weight_update")
    except BaseException:
        with contextlib.suppress(Exception):
            await get_engine(request).call("finish_weight_update", abort=True)
        raise


def _param_meta(body: UpdateNamedParamRequest) -> ParamMeta:
    if not body.name:
        raise bad_request("name: must be a non-empty string", "body.name")
    try:
        dtype = parse_dtype_name(body.dtype, "dtype")
    except InvalidArgument as e:
        raise bad_request(str(e), "body.dtype") from None
    bad = next((s for s in body.shape if s < 0), None)
    if bad is not None:
        raise bad_request(f"shape: sizes must be >= 0, got {body.shape}", "body.shape")
    return ParamMeta(body.name, dtype, tuple(body.shape))


async def _check_against_model(session: _Session, engine: AsyncLLM, meta: ParamMeta) -> None:
    """What the engine's round would refuse (an unknown name, a shape or dtype kind that
    does not fit), refused before the trainer sends: the engine checks again on receipt."""
    if session.model is None:
        try:
            session.model = await off_loop(_meta_model, engine)
        except Exception as e:  # noqa: BLE001 - the engine still checks every tensor
            logger.warning("TRL: no parameter table for early checks (%s)", e)
            return
    try:
        target = session.model.checkpoint_view(meta.name)
    except ValueError as e:
        raise bad_request(f"name: {e}", "body.name") from None
    if target is None:
        return  # a name the model ignores (e.g. rotary inv_freq)
    dest = target[1]
    if tuple(dest.shape) != meta.shape:
        raise bad_request(f"shape: {list(meta.shape)} does not fit {meta.name!r}: the model "
                          f"expects {list(dest.shape)}", "body.shape")  # fmt: skip
    if dest.is_floating_point() != meta.dtype.is_floating_point:
        raise bad_request(f"dtype: {meta.dtype} does not fit {meta.name!r} ({dest.dtype})",
                          "body.dtype")  # fmt: skip


def _meta_model(engine: AsyncLLM) -> torch.nn.Module:
    """The served model's class on the meta device: its names and shapes, no memory."""
    from hotswap.model.models.registry import get_model_class

    config = engine.config.model
    with torch.device("meta"):
        return get_model_class(config.architecture)(
            config.hf_config, config.dtype, None, False, config.head_dtype
        )


@_control.post("/reset_prefix_cache/")
async def reset_prefix_cache(request: Request) -> dict[str, str]:
    """After a sync: waits for the last parameter's commit (reporting its failure)."""
    session = _session(request)
    async with session.lock:
        failure = await _settle(session)
        if failure is not None:
            raise failure
        await get_engine(request).call("reset_prefix_cache")
    return {"message": "Request received, resetting prefix cache status: True"}


@_control.post("/close_communicator/")
async def close_communicator(request: Request) -> dict[str, str]:
    """Waits for the last parameter's commit (reporting its failure, still closing),
    cancels an init still waiting for its trainer, and leaves the group (its port is free
    for the trainer's next init)."""
    engine = get_engine(request)
    session = _session(request)
    async with session.lock:
        await _cancel_init(session, engine)
        joining = session.pending is not None and session.pending.is_init
        failure = await _settle(session)
        if session.open:
            await _leave_group(engine)
        session.open = False
        if failure is not None and not joining:  # an init's failure: nothing was lost
            raise failure
    return {"message": "Request received, closing communicator"}


async def _leave_group(engine: AsyncLLM) -> None:
    """Drop the engine's broadcast group (refused mid-round: another client's round is
    left alone)."""
    with contextlib.suppress(EngineStateError):
        await engine.call("leave_weight_transfer")


trl_router.include_router(_control)
