"""From a validated `/inference/v1/generate` body to engine inputs: what hotswap refuses,
the `SamplingParams` (built exactly as /v1/completions builds them), the prompt check and
the structured-output gate after thinking.

Invariants, and why:
- Every field vLLM's `GenerateRequest` / `SamplingParams` knows is honoured, has no
  observable effect (vLLM-internal knobs), or is refused here with 400 naming it
  (`body.sampling_params.<field>`); none is dropped in silence.
- Sampling values go through `params.sampling_params` and the engine's
  `prepare_params`, the building blocks of /v1/completions, so temperature, penalties,
  logit_bias (clamped to +-100), allowed_token_ids, bad_words and structured_outputs
  behave the same on both routes; their errors are re-rooted under `sampling_params`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.prompts import check_prompt, prepare_params
from hotswap.entrypoints.openai.chat_tools import gate_constraint_after_thinking
from hotswap.entrypoints.openai.generate_protocol import GenerateRequest, GenerateSamplingParams
from hotswap.entrypoints.openai.params import EnginePrompt, place_images, sampling_params
from hotswap.entrypoints.openai.parsers import REASONING_PARSERS
from hotswap.entrypoints.openai.protocol import SamplingRequest
from hotswap.entrypoints.server.default_only import DefaultOnly, Only, check_default_only
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.sampling import SHARED_FIELDS
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.errors import InvalidArgument
from hotswap.sampling_params import SamplingParams

SP = "body.sampling_params"
# vLLM's cache-salt rule (generate/base/protocol.py: validate_cache_salt)
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")

# The body's and sampling_params' fields hotswap cannot honour: accepted only while unset
# (null; content_parts, a list by its type, empty too)
_REFUSAL = "{name}: {why} is not supported by hotswap"
BODY_DEFAULT_ONLY = DefaultOnly(
    {
        "features": Only(why="multimodal inputs"),
        "kv_transfer_params": Only(why="KV transfer"),
        "ec_transfer_params": Only(why="encoder-cache transfer"),
    },
    _REFUSAL,
)
SAMPLING_DEFAULT_ONLY = DefaultOnly(
    {
        "prompt_logprob_token_ids": Only(why="scoring chosen token ids per prompt row"),
        "prompt_logprob_start": Only(why="scoring from a prompt row other than the first"),
        "logprob_token_ids": Only(why="logprobs of chosen token ids"),
        "thinking_token_budget": Only(why="a thinking token budget"),
        "repetition_detection": Only(why="repetition detection"),
        "trace_decode_token_ids": Only(why="forcing a decode trace"),
    },
    _REFUSAL,
)
# the fields copied as they are into the SamplingRequest that /v1/completions builds from:
# the shared ones and the vLLM fields that /v1/completions reads beside them
_COPIED = (
    *SHARED_FIELDS,
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "structured_outputs",
    "routed_experts_prompt_start",
    "return_bf16_logprobs",
)


def check_unsupported_generate(body: GenerateRequest) -> None:
    """400 naming the first field whose value hotswap would otherwise have to ignore."""
    check_default_only(BODY_DEFAULT_ONLY, body)
    _check_cache_salt(body.cache_salt)
    _check_sampling_fields(body.sampling_params)
    if body.output_mode != "tokens" and not body.sampling_params.detokenize:
        raise bad_request(
            f"output_mode: {body.output_mode!r} requires sampling_params.detokenize to be true",
            "body.output_mode",
        )


def _check_sampling_fields(sp: GenerateSamplingParams) -> None:
    check_default_only(SAMPLING_DEFAULT_ONLY, sp, SP)
    if sp.watermarking:
        raise bad_request("watermarking: hotswap has no watermark", f"{SP}.watermarking")
    if sp.extra_args:
        raise bad_request(
            "extra_args: hotswap has no sampling plugins to read them",
            f"{SP}.extra_args",
        )
    so = sp.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        raise bad_request(
            "whitespace_pattern: not supported by hotswap (disable_any_whitespace is)",
            f"{SP}.structured_outputs.whitespace_pattern",
        )
    if sp.stop and not sp.detokenize:  # vLLM's SamplingParams refuses this too
        raise bad_request(
            "stop: stop strings are only supported when detokenize is true",
            f"{SP}.stop",
        )


def _check_cache_salt(salt: str | None) -> None:
    if salt is not None and (
        len(salt) > MAX_CACHE_SALT_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in salt)
    ):
        raise bad_request(
            "cache_salt: must be at most 128 characters and must not contain '@', '/', "
            "'\\', or NUL",
            "body.cache_salt",
        )


def generate_sampling_params(
    sp: GenerateSamplingParams, *, stream: bool, defaults: Mapping[str, Any]
) -> SamplingParams:
    """hotswap's SamplingParams, built by /v1/completions' `sampling_params` from the
    same values: a bad one is 400 `body.sampling_params.<field>`. As in vLLM's route the
    model's generation_config (`defaults`) supplies `max_tokens` alone, and only when the
    body omits it (then None without one: up to the context limit); every other field
    keeps SamplingParams' own default (temperature 1.0, ...), not the model's."""
    fields: dict[str, Any] = {name: getattr(sp, name) for name in _COPIED}
    if sp.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in sp.logit_bias.items()}
    request = SamplingRequest.model_construct(**fields)
    given = "max_tokens" in sp.model_fields_set
    max_tokens = sp.max_tokens if given else defaults.get("max_tokens")
    try:
        return sampling_params(request, max_tokens=max_tokens, logprobs=sp.logprobs, stream=stream)
    except APIError as e:
        raise _under_sampling_params(e) from None


def _under_sampling_params(error: APIError) -> APIError:
    """`body.x` (a SamplingRequest field) -> `body.sampling_params.x`."""
    param = error.param
    if param is not None and param.startswith("body.") and not param.startswith(SP):
        param = f"{SP}.{param.removeprefix('body.')}"
    return APIError(error.status, error.message, param)


def prepare_generate_params(engine: AsyncLLM, params: SamplingParams) -> None:
    """The engine's own checks (token ids in the vocabulary, bad words, the grammar),
    run here so that a refusal names `body.sampling_params.<field>`; the engine repeats
    them at submit, where they are then no-ops or pass."""
    try:
        prepare_params(params, engine.tokenizer, engine.config)
    except InvalidArgument as e:
        param = f"{SP}.{e.field}" if e.field else SP
        raise bad_request(str(e), param) from None


def generate_prompt(engine: AsyncLLM, body: GenerateRequest) -> EnginePrompt:
    """The token ids exactly as sent (never re-tokenized), checked against the vocabulary
    and the context (400 `body.token_ids`). `skip_reading_prefix_cache` is honoured with a
    salt no other request has: this request then shares no cached KV."""
    ids = list(body.token_ids)
    config = engine.config
    try:
        check_prompt(ids, config.model.vocab_size, config.scheduler.max_model_len)
    except ValueError as e:
        detail = str(e).split(": ", 1)[-1]
        raise bad_request(f"token_ids: {detail}", "body.token_ids") from None
    prompt = EnginePrompt(None, ids, body.cache_salt)
    if body.sampling_params.skip_reading_prefix_cache:
        prompt.cache_salt = f"{body.cache_salt or ''}#skip-{uuid.uuid4().hex}"
    sources = content_part_images(body.content_parts or [])
    return place_images(engine, prompt, sources, "content_parts") if sources else prompt


def content_part_images(parts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(field, url) of each of vLLM's `content_parts` ({"type": "image_url", "url": ...};
    the chat form {"image_url": {"url": ...}} too); 400 for other media."""
    found = []
    for i, part in enumerate(parts):
        field = f"content_parts[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "image_url":
            raise bad_request(f"{field}.type: {kind!r} is not supported (image_url only)",
                              f"body.{field}.type")  # fmt: skip
        url = part.get("url", part.get("image_url"))
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise bad_request(f"{field}.url: must be a string", f"body.{field}.url")
        found.append((field, url))
    return found


def gate_after_thinking(
    engine: AsyncLLM, server: ServerConfig, body: GenerateRequest, params: SamplingParams
) -> None:
    """vLLM's rule for a constraint under a reasoning parser: the thinking is free, the
    grammar applies after the end-of-thinking tag. `reasoning_ended` true: from the first
    token; false: after the tag; null: the parser reads the prompt (and
    `reasoning_parser_kwargs.chat_template_kwargs.enable_thinking: false` means ended)."""
    constraint = params.structured_outputs
    name = server.reasoning_parser
    if constraint is None or not name or server.structured_outputs.enable_in_reasoning:
        return
    if body.reasoning_ended is None:
        kwargs = body.reasoning_parser_kwargs
        if kwargs is not None and kwargs.chat_template_kwargs.get("enable_thinking") is False:
            return
        text = engine.tokenizer.decode(body.token_ids, skip_special_tokens=False)
        if REASONING_PARSERS[name]().is_reasoning_end(text):
            return
    elif body.reasoning_ended:
        return
    end_tag = REASONING_PARSERS[name].end_tag
    end_ids = engine.tokenizer.encode(end_tag, add_special_tokens=False)
    gate_constraint_after_thinking(constraint, end_ids)
