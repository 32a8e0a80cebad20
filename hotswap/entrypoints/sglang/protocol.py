"""SGLang's POST /generate request body: GenerateReqInput
(python/sglang/srt/managers/io_struct.py) and its SamplingParams
(python/sglang/srt/sampling/sampling_params.py), as far as hotswap serves them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator

from hotswap.entrypoints.openai.protocol import RequestModel
from hotswap.entrypoints.server.default_only import DefaultOnly, Only, absent
from hotswap.entrypoints.server.limits import MAX_FLOAT, json_problem
from hotswap.entrypoints.server.sampling import (
    MAX_N,
    Int64,
    NonNegInt64,
    Stop,
    TokenCount,
    TokenIds,
)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, when the field is absent (null: up to the context)
MAX_RID_CHARS = 512
# SamplingParams' names -> SGLang's: where the shared fields are read from, and the names
# SamplingParams' refusals are given in
SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}


class SGLangSampling(RequestModel):
    """SGLang's sampling_params; null means the default, as in SGLang. Its own bounds
    where SGLang's differ from vLLM's: `n` >= 1 here, `top_k` and `sampling_seed` any
    int64 (a top_k past the vocabulary is every token)."""

    max_new_tokens: TokenCount | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # -1, or more than the vocabulary: every token
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    sampling_seed: Int64 | None = None
    stream_interval: Any = None  # chunk cadence only: hotswap streams every step
    custom_params: Any = None  # read only by a custom logit processor: ignored, with a warning
    max_weight_lag: NonNegInt64 | None = None  # hotswap's extension (see SamplingParams)
    # SGLang's constraints (one at most): a JSON schema as JSON text, a regex, a GBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias
    # accepted only at their defaults
    stop_regex: Any = None
    structural_tag: Any = None


class GenerateRequest(RequestModel):
    """SGLang's GenerateReqInput. Fields that take a value or one per prompt are checked
    here, in code, so that a 400 names exactly the offending element."""

    text: Any = None  # a prompt or a list of prompts
    input_ids: Any = None  # token ids or a list of them
    sampling_params: Any = None  # one dict, or one per prompt
    rid: Any = None  # str (a prefix `{rid}_{i}` for a batch) or one per prompt
    return_logprob: Any = None
    logprob_start_len: Any = None  # -1: only the last prompt token
    top_logprobs_num: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: Any = None  # str or one per prompt
    return_prompt_token_ids: bool = False
    lora_path: Any = None  # a loaded LoRA adapter's name, or one (or null) per prompt
    # bool or one per prompt: meta_info.routed_experts (--enable-return-routed-experts)
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None  # the first position returned (with the above)
    # hotswap (--enable-bf16-logprobs): meta_info.bf16_logprobs, each output token's
    # logprob under the bf16 weights of an FP8 engine
    return_bf16_logprobs: bool = False
    # Data-parallel routing (server/routing.py): a session key, an explicit rank (newer
    # name first); one, or one per prompt
    routing_key: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    # Observability hints with no meaning on a hotswap server: ignored.
    log_metrics: Any = None
    conversation_id: Any = None
    custom_labels: Any = None
    no_logs: Any = None
    received_time: Any = None
    external_trace_header: Any = None
    # accepted only at their defaults (absent, null, false or empty)
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    session_params: Any = None
    return_hidden_states: Any = None
    return_entropy: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None
    extra_key: Any = None
    bootstrap_host: Any = None
    bootstrap_room: Any = None

    @field_validator("*")
    @classmethod
    def _checked(cls, value: Any, info: ValidationInfo) -> Any:
        """CheckedModel's check (valid Unicode, bounded floats and nesting), but for
        sampling_params, which SGLangSampling checks per prompt to name the exact field."""
        if info.field_name == "sampling_params":
            return value
        problem = json_problem(value, "", MAX_FLOAT)
        if problem is not None:
            raise ValueError(problem[1].removeprefix(": "))
        return value


# Accepted at their defaults alone (absent, null, false or empty), the body's and each
# sampling_params'
_REFUSAL = (
    "{field}: {short} is not supported by hotswap (only an absent, null, false or empty "
    "value is accepted)"
)
DEFAULT_ONLY = DefaultOnly(
    dict.fromkeys(
        [
            "input_embeds",
            "video_data",
            "audio_data",
            "custom_logit_processor",
            "token_ids_logprob",
            "session_params",
            "return_hidden_states",
            "return_entropy",
            "return_sampling_mask",
            "return_flat_raw_top_logprobs",
            "extra_key",
            "bootstrap_host",
            "bootstrap_room",
        ],
        Only(),
    ),
    _REFUSAL,
    absent,
)
SAMPLING_DEFAULT_ONLY = DefaultOnly(
    dict.fromkeys(["stop_regex", "structural_tag"], Only()), _REFUSAL, absent
)
