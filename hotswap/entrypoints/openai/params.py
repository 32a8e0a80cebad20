"""From a validated request model to engine inputs: the model check, request ids,
unsupported parameters, `SamplingParams` and prompt (length) checks."""

from __future__ import annotations

import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.prompts import check_prompt, encode_prompt
from hotswap.entrypoints.openai.constraints import logit_bias_of, structured_outputs_of
from hotswap.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestModel,
    SamplingRequest,
)
from hotswap.entrypoints.server.default_only import DefaultOnly, Only, check_default_only
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.limits import WarningThrottle, check_prompt_chars, printable_field
from hotswap.entrypoints.server.routing import Routing
from hotswap.entrypoints.server.sampling import build_sampling_params
from hotswap.entrypoints.server.state import get_engine, get_lora_ids, get_server_config
from hotswap.errors import InvalidArgument
from hotswap.lora.request import LoRARequest
from hotswap.multimodal.images import ProcessedImage
from hotswap.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# vLLM's words, so that log searches written for vLLM find hotswap's warning too.
IGNORED_FIELDS_WARNING = "The following fields were present in the request but ignored"
MAX_FIELDS_NAMED = 10  # in one warning; a body can hold thousands of keys
# Each distinct (route, set of ignored fields) is logged at most once a minute, and at most
# 20 such warnings a minute in all: an RL client sends the same extra fields on every one
# of thousands of requests, and a flood would bury every other log line. The number of
# warnings held back is reported with the next one logged.
_ignored_fields_throttle = WarningThrottle(interval_s=60.0, max_per_interval=20)

# Accepted at their defaults alone: beam search is not implemented; vLLM refuses a
# suffix too.
DEFAULT_ONLY = DefaultOnly(
    {
        "length_penalty": Only((None, 1)),
        "use_beam_search": Only((False,)),
        "suffix": Only((None, "")),
    },
    "{name}: {value!r} is not supported by hotswap (allowed: {allowed})",
)


@dataclass
class EnginePrompt:
    """One prompt, tokenized and checked: what `AsyncLLM.generate` receives."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs on (None: the base model)
    routing: Routing = Routing()  # which data-parallel rank (server/routing.py)
    priority: int = 0  # the body's `priority` (--scheduling-policy priority)
    kv_retention_s: float = 0.0  # keep its KV after it finishes (engine/kv_cache.py)
    # its images, processed, their placeholders in `token_ids` expanded (multimodal models)
    images: list[ProcessedImage] | None = None
    placeholders: list[tuple[int, int]] | None = None  # each image's (offset, length)

    def as_input(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids, "prompt": self.text}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        if self.images:
            prompt["multi_modal_data"] = {"image": self.images}
        return prompt


def served_model_name(request: Request) -> str:
    return get_server_config(request).served_model_name


def check_model(request: Request, model: str | None) -> LoRARequest | None:
    """None when `model` is omitted or names the served model; the adapter's request when
    it names a loaded LoRA adapter (vLLM's); else 404, as vLLM / OpenAI."""
    if model is None or model == served_model_name(request):
        return None
    lora = adapter_request(request, model)
    if lora is None:
        raise APIError(404, f"The model `{model}` does not exist.", "body.model")
    return lora


def adapter_request(request: Request, name: str) -> LoRARequest | None:
    """The LoRARequest for the adapter loaded under `name` (None: no such adapter)."""
    path = get_engine(request).loaded_adapters.get(name)
    if path is None:
        return None
    return LoRARequest(name, get_lora_ids(request).of(name), path)


def model_name(request: Request, lora: LoRARequest | None) -> str:
    """A response's `model`: the adapter's name if the request runs on one (vLLM's)."""
    return lora.lora_name if lora is not None else served_model_name(request)


def base_request_id(request: Request, body_id: str | None, prefix: str) -> str:
    """The response id (= engine request id): X-Request-Id header, else the body's
    `request_id`, else `{prefix}-{uuid}` (vLLM gives the header precedence too)."""
    header = request.headers.get("x-request-id")
    return header or body_id or f"{prefix}-{uuid.uuid4().hex}"


def check_unknown_fields(
    request: Request, unknown: Sequence[str], ignored: Sequence[str] = ()
) -> None:
    """The policy for a request's fields that no parameter declares (`unknown`, nested
    ones as `stream_options.foo`): ignored with a (throttled) warning, as vLLM does, or
    under --reject-unknown-fields a 400 naming the first, `body.<field>`, as before the
    flag. `ignored`: fields known but ignored (SGLang's custom_params), only ever warned
    about, in the same warning. Messages are free-form objects handed to the chat
    template whole, never refused. A route with a request-model body gets this from its
    router (`UnknownFieldsRoute`); nested bodies checked in code (SGLang's per-prompt
    sampling_params) call it themselves."""
    if unknown and get_server_config(request).reject_unknown_fields:
        field = printable_field(unknown[0])
        raise bad_request(
            f"{field}: Extra inputs are not permitted (unknown field; this server runs "
            f"with --reject-unknown-fields)",
            f"body.{field}",
        )
    if unknown or ignored:
        warn_ignored_fields(request.url.path, [*unknown, *ignored])


class UnknownFieldsRoute(APIRoute):
    """A route whose request-model body (`RequestModel`) passes `check_unknown_fields`
    before the endpoint runs: a dialect's router declares it once
    (`APIRouter(route_class=UnknownFieldsRoute)`) instead of a call in every route.

    The endpoint is wrapped with its signature kept (FastAPI reads the parameters and
    their module through `__wrapped__`), so the body is validated, and refused, exactly
    as before, and the policy runs on a valid body only, after the router's
    dependencies, as the call at the top of each route did."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, _checking_unknown_fields(endpoint), **kwargs)


def _checking_unknown_fields(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    # FastAPI's include_router has re-created a router's routes with their class and the
    # already wrapped endpoint (hotswap accepts fastapi >= 0.110): wrapping again would
    # check, and warn, twice.
    if getattr(endpoint, "_checks_unknown_fields", False):
        return endpoint
    parameters = inspect.signature(endpoint, eval_str=True).parameters.values()
    bodies = [p.name for p in parameters if _is_request_model(p.annotation)]
    requests = [p.name for p in parameters if p.annotation is Request]
    if not bodies:
        return endpoint
    if not requests or not inspect.iscoroutinefunction(endpoint):
        raise TypeError(f"{endpoint.__qualname__}: a route with a request body must be an "
                        "async def declaring `request: Request`")  # fmt: skip

    @functools.wraps(endpoint)
    async def checked(**values: Any) -> Any:  # FastAPI passes every parameter by name
        for name in bodies:
            check_unknown_fields(values[requests[0]], values[name].unknown_fields)
        return await endpoint(**values)

    checked._checks_unknown_fields = True  # type: ignore[attr-defined]
    return checked


def _is_request_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, RequestModel)


def warn_ignored_fields(
    path: str, names: Sequence[str], throttle: WarningThrottle = _ignored_fields_throttle
) -> bool:
    """Log one warning naming the ignored fields of one request, unless `throttle` holds
    it back; True if it was logged."""
    shown = sorted({printable_field(n) for n in names})
    listed = ", ".join(repr(n) for n in shown[:MAX_FIELDS_NAMED])
    if len(shown) > MAX_FIELDS_NAMED:
        listed += f", ... ({len(shown) - MAX_FIELDS_NAMED} more)"
    key = f"{path} {listed}"
    admitted = throttle.admit(key)
    if admitted is None:
        return False
    held_same, held_other = admitted
    notes = [path]
    if held_same:
        notes.append(f"{held_same} more requests with these fields since the last warning")
    if held_other:
        notes.append(f"{held_other} warnings about other ignored fields held back")
    window = f"{throttle.interval_s:g} s"
    logger.warning(
        "%s: {%s} (%s; each set of fields is logged at most once per %s)",
        IGNORED_FIELDS_WARNING,
        listed,
        "; ".join(notes),
        window,
    )
    return True


def check_unsupported(body: SamplingRequest) -> None:
    """400 for any parameter that hotswap would otherwise have to ignore."""
    check_default_only(DEFAULT_ONLY, body)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise bad_request(f"best_of: must equal n ({body.n}) if given", "body.best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "body.stream_options")


def apply_server_flags(request: Request, body: SamplingRequest) -> None:
    """Server-wide defaults that vLLM takes as flags (--return-tokens-as-token-ids)."""
    if get_server_config(request).return_tokens_as_token_ids:
        body.return_tokens_as_token_ids = True


def sampling_params(
    body: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """Build (and so validate) the SamplingParams; a bad value becomes 400 `body.<field>`.
    `prompt_logprobs` overrides the body's (echo with logprobs needs them);
    `structured_outputs` the body's constraint (a forced tool call sets its own);
    `defaults` the model's sampling defaults (generation_config), for fields the body
    leaves unset."""
    defaults = defaults or {}
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    if prompt_logprobs is None:
        prompt_logprobs = body.prompt_logprobs
    if structured_outputs is None:
        structured_outputs = structured_outputs_of(body)
    # a refusal of max_tokens names max_completion_tokens where that was given (chat)
    given_as = max_tokens_param(body).removeprefix("body.")
    names = {"max_tokens": given_as} if given_as != "max_tokens" else {}
    try:
        return build_sampling_params(
            body,
            names=names,
            defaults=defaults,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            routed_experts_prompt_start=routed_experts_start(body),
            return_bf16_logprobs=body.return_bf16_logprobs,
            logit_bias=logit_bias_of(body),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or None,
            structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
    except InvalidArgument as e:
        raise bad_request(str(e), f"body.{e.field}" if e.field else None) from None


def routed_experts_start(body: SamplingRequest) -> int:
    """vLLM's routed_experts_prompt_start, or SGLang's routed_experts_start_len (read, as
    SGLang does, only with its return_routed_experts)."""
    if body.routed_experts_prompt_start or not body.return_routed_experts:
        return body.routed_experts_prompt_start
    if body.routed_experts_start_len < 0:
        raise bad_request(
            f"routed_experts_start_len: {body.routed_experts_start_len} is lower than 0; use "
            "a non-negative routed_experts_start_len",
            "body.routed_experts_start_len",
        )
    return body.routed_experts_start_len


def completion_max_tokens(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def max_tokens_param(body: SamplingRequest) -> str:
    if getattr(body, "max_completion_tokens", None) is not None:
        return "body.max_completion_tokens"
    return "body.max_tokens"


def prepare_prompt(
    engine: AsyncLLM,
    prompt: str | list[int],
    *,
    add_special_tokens: bool = True,
    truncate: int | None = None,
    param: str = "body.prompt",
) -> EnginePrompt:
    """Tokenize and check one prompt (vocabulary, context length): 400 with `param`."""
    if isinstance(prompt, str):
        check_prompt_chars(engine, prompt, truncate, param)  # before the costly encode
        text, ids = prompt, engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        text, ids = encode_prompt(engine.tokenizer, prompt)
    if truncate is not None and len(ids) > truncate:
        text, ids = None, ids[-truncate:]
    try:
        check_prompt(ids, engine.config.model.vocab_size, engine.config.scheduler.max_model_len)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return EnginePrompt(text, ids)


def place_images(engine: AsyncLLM, prompt: EnginePrompt, sources: list[tuple[str, str]],
                 field: str, overrides: dict[str, Any] | None = None) -> EnginePrompt:  # fmt: skip
    """The prompt with its images ((field, url) each) loaded and processed and their
    placeholders expanded once (the engine then keeps them as they are); 400 naming the
    image's field, or `field` (the body's, that holds them all), when refused."""
    if engine.images is None:
        raise bad_request(f"{field}: this model does not take images", f"body.{field}")
    fields = [field for field, _ in sources]
    try:
        engine.images.check_count(len(sources), field)
        images = [engine.images.process(url, name, overrides) for name, url in sources]
        ids, placed = engine.images.place(prompt.token_ids, images, field, fields)
    except InvalidArgument as e:
        raise bad_request(str(e), f"body.{e.field}") from None
    try:
        check_prompt(ids, engine.config.model.vocab_size, engine.config.scheduler.max_model_len)
    except ValueError as e:
        raise bad_request(str(e), f"body.{field}") from None
    ranges = [(image.offset, image.length) for image in placed]
    return replace(prompt, token_ids=ids, images=images, placeholders=ranges)


def check_context_length(
    engine: AsyncLLM, prompt: EnginePrompt, max_tokens: int | None, param: str
) -> None:
    """400, as vLLM, when the prompt plus max_tokens does not fit in the context."""
    limit = engine.config.scheduler.max_model_len
    num = len(prompt.token_ids)
    if max_tokens is not None and num + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num + max_tokens} tokens ({num} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param,
        )
