"""The request bodies of TRL's `trl vllm-serve` routes (trl/scripts/vllm_serve.py) and
their field checks, as far as hotswap serves them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from hotswap.entrypoints.openai.protocol import RequestModel
from hotswap.entrypoints.server.default_only import DefaultOnly, Only, equal
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.sampling import (
    MAX_N,
    Logprobs,
    N,
    NonNegInt64,
    Seed,
    Stop,
    TokenCount,
    TokenIds,
    TopK,
)
from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.dtypes import parse_dtype_name


class SamplingFields(RequestModel):
    """The sampling fields /generate/ and /chat/ share (TRL's defaults; the OpenAI
    routes' bounds, value checks left to SamplingParams)."""

    n: N = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: TopK = -1
    min_p: float = 0.0
    max_tokens: TokenCount = 16
    logprobs: Logprobs | None = 0
    structured_outputs_regex: str | None = None
    guided_decoding_regex: str | None = None  # its name before TRL 0.27 (vLLM 0.12 support)
    truncate_prompt_tokens: int | None = None  # sent until TRL's vLLM 0.17 support
    generation_kwargs: dict[str, Any] | None = Field(default_factory=dict)


class GenerateRequest(SamplingFields):
    prompts: list[str] | list[list[int]]
    images: list[Any] | None = None


class ChatRequest(SamplingFields):
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
    seed: Seed | None = None
    max_tokens: TokenCount | None = 16
    min_tokens: TokenCount = 0
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
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
# The vLLM fields hotswap accepts only at vLLM's default (anything else is refused, never
# ignored); generation_kwargs are raw JSON values, compared by `==` as TRL's dict holds them.
DEFAULT_ONLY_KWARGS = DefaultOnly(
    {
        "best_of": Only(),
        "detokenize": Only((True,)),
        "logits_processors": Only(),
        "bad_words": Only(),
        "allowed_token_ids": Only(),
        "logit_bias": Only(),
        "prompt_logprobs": Only(),
        "truncate_prompt_tokens": Only(),
        "structured_outputs": Only(),
        "guided_decoding": Only(),
        "extra_args": Only(),
        "flat_logprobs": Only((False,)),
    },
    "{field}: not supported (only {allowed})",
    equal,
)


def check_no_images(body: GenerateRequest) -> None:
    """TRL sends `images: null` (or one null per prompt) for text prompts: anything else
    is refused, never ignored."""
    for i, images in enumerate(body.images or []):
        if images is not None:
            raise bad_request(f"images[{i}]: this server has no image input", f"body.images[{i}]")


def check_text_only(messages: list[dict[str, Any]], index: int) -> None:
    """Conversation `index` holds text parts only (strings or {"type": "text"})."""
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


def param_meta(body: UpdateNamedParamRequest) -> ParamMeta:
    """The parameter's format checked on its own (name, dtype, shape), before the model."""
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
