"""Request and response models of vLLM 0.32's token-in/token-out route,
`POST /inference/v1/generate` (vLLM: entrypoints/scale_out/token_in_token_out/protocol.py).

Invariants, and why:
- Field names, nesting and defaults are vLLM's, so a body written for vLLM means the same
  here: `token_ids` plus a nested `sampling_params` object that is vLLM's engine-level
  `SamplingParams` (its defaults: temperature 1.0, max_tokens 16 when given, ...).
- Requests validate laxly like every hotswap request model (`RequestModel`): what vLLM's
  pydantic models coerce ("logprobs": true is 1, "n": "2" is 2) is coerced; unknown
  fields, nested ones as `sampling_params.foo` too, are ignored with the usual warning.
  Fields vLLM knows and hotswap cannot honour are declared here so that they are never
  mistaken for unknown ones; `generate_params.check_unsupported_generate` refuses them
  with a 400 naming the field.
- Responses serialize every field, nulls included, as vLLM's `JSONResponse(model_dump())`
  does; stream chunks are dumped by the route with vLLM's exclusions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from hotswap.entrypoints.openai.protocol import (
    KVRetention,
    RequestModel,
    SessionId,
    StreamOptions,
    StructuredOutputsRequest,
)
from hotswap.entrypoints.openai.responses import ChatLogProbsContent, PromptLogprob
from hotswap.entrypoints.server.limits import CheckedModel
from hotswap.entrypoints.server.sampling import (
    I64,
    Int64,
    N,
    NonNegInt64,
    Seed,
    Stop,
    TokenCount,
    TokenIds,
    TopK,
)

OutputMode = Literal["tokens", "text"]


class GenerateSamplingParams(RequestModel):
    """vLLM's `SamplingParams` as the route reads it from JSON: same names and defaults.
    Value ranges are checked by hotswap's `SamplingParams` (400 naming
    `body.sampling_params.<field>`); types here. `max_tokens` omitted means the model's
    generation_config default, else "up to the context limit" (vLLM's server-side
    default), not the class default 16; the other defaults are the class's, as in vLLM."""

    n: N = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: TopK = 0
    min_p: float = 0.0
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    max_tokens: TokenCount | None = 16
    min_tokens: TokenCount = 0
    logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: Int64 | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False  # vLLM's container format: no effect on the JSON
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: Literal[0, 1, 2] = 0  # vLLM's route overrides it (stream or not), so do we
    stream_interval: Annotated[int, Field(ge=1, lt=I64)] | None = None
    skip_clone: bool = False  # vLLM-internal copy avoidance: no observable effect
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: TokenIds | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: Int64 | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: Int64 = 0  # with --enable-return-routed-experts
    trace_decode_token_ids: list[int] | None = None
    # hotswap extension (as on /v1/completions): abort instead of straddling more commits
    max_weight_lag: NonNegInt64 | None = None
    # hotswap extension (as on /v1/completions; --enable-bf16-logprobs)
    return_bf16_logprobs: bool = False


class ReasoningParserKwargs(CheckedModel):
    """vLLM's typed kwargs for the engine-side reasoning parser; unknown keys are refused
    (extra="forbid" there too, so clients cannot pass arbitrary parser arguments)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class GenerateRequest(RequestModel):
    """POST /inference/v1/generate: `token_ids` (non-empty, non-negative, in the
    vocabulary) and `sampling_params` (required, as in vLLM)."""

    request_id: Annotated[str, Field(max_length=512)] | None = None
    token_ids: Annotated[list[NonNegInt64], Field(min_length=1)]
    token_offsets: list[tuple[int, int]] | None = None  # /render metadata; unused, as vLLM
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: GenerateSamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: OutputMode = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    session_id: SessionId | None = None  # hotswap: as X-Session-ID (server/routing.py)
    kv_retention_s: KVRetention = 0.0  # hotswap: as on the OpenAI routes
    priority: Int64 = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


# -- responses ----------------------------------------------------------------------------


class GenerateLogProb(BaseModel):
    """One candidate: the integer token id (the tokens level carries no token text), and
    `token` as "token_id:N": vLLM 0.22's shape of this route, which prime-rl pins and
    verifiers' training client (renderers) requires; current vLLM clients ignore it."""

    token_id: int
    logprob: float
    rank: int | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def token(self) -> str:
        return f"token_id:{self.token_id}"


class GenerateLogProbsContent(GenerateLogProb):
    """The sampled token, then its candidates in vLLM's order: the sampled token first,
    then the others by rank, cut at max(logprobs, 1)."""

    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class TextLogProbs(BaseModel):
    """`output_mode: "text"`: the chat shape (token text and bytes), as vLLM's."""

    content: list[ChatLogProbsContent] | None = None


class GenerateWeightSpan(BaseModel):
    """vLLM 0.32's `WeightVersionSpan` (output tokens [start, end) came from weights
    labelled `version`, a string: the label a trainer set), plus hotswap's provenance:
    `label` (the same string, the name the other routes use), `weight_gen` (hotswap's
    integer version, the RL RFC's name) and `stale`. `version` cannot be hotswap's
    integer here: vLLM's own response model refuses a non-string version."""

    version: str
    start: int
    end: int
    label: str
    weight_gen: int
    stale: bool = False
    # the LoRA adapter that produced them and its loaded version (omitted: the base)
    lora_name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    lora_version: int | None = Field(default=None, exclude_if=lambda v: v is None)


class GeneratePromptTokensDetails(BaseModel):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class GenerateUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: GeneratePromptTokensDetails | None = None
    completion_tokens_details: dict[str, int] | None = None


class GenerateChoice(BaseModel):
    """Fields shared by both output modes, streaming or not (vLLM's choice bases).
    `routed_experts` (with --enable-return-routed-experts, on the final choice) is
    encoded as on /v1/completions; `sampling_mask` stays null (vLLM's value with that
    option off)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[GenerateWeightSpan] | None = None
    # return_bf16_logprobs, on the final choice; left out while unset (vLLM has no such key)
    bf16_logprobs: list[float] | None = Field(default=None, exclude_if=lambda v: v is None)


class GenerateTokensChoice(GenerateChoice):
    logprobs: GenerateLogProbs | None = None


class GenerateTextChoice(GenerateChoice):
    text: str
    logprobs: TextLogProbs | None = None


class GenerateResponse(BaseModel):
    """The non-streaming answer (vLLM's GenerateTokensResponse / GenerateTextResponse)."""

    request_id: str
    model: str | None = None
    created: int | None = None
    usage: GenerateUsage | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: OutputMode = "tokens"
    choices: list[GenerateTokensChoice | GenerateTextChoice]


class GenerateStreamResponse(BaseModel):
    """One stream chunk (vLLM's GenerateTokensStreamResponse / GenerateTextStreamResponse)."""

    request_id: str
    usage: GenerateUsage | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    output_mode: OutputMode = "tokens"
    choices: list[GenerateTokensChoice | GenerateTextChoice]
