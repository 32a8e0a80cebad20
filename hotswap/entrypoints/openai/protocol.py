"""Request models of the OpenAI-compatible API (vLLM's dialect).

Unknown fields are ignored with a logged warning, as vLLM does (RL clients send fields
they do not need answered), or refused with 400 naming the field under
`--reject-unknown-fields` (`params.check_unknown_fields`, which each router's
`params.UnknownFieldsRoute` runs). OpenAI / vLLM parameters that hotswap does not implement
are declared so that their default value is accepted (`params.DEFAULT_ONLY`), and
`params.check_unsupported` rejects anything else: a known parameter is never silently
ignored. Value checks that `SamplingParams` already makes (temperature >= 0, ...) are left
to it.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from hotswap.engine.prompts import MAX_KV_RETENTION_S, MAX_SESSION_ID_CHARS
from hotswap.entrypoints.server.limits import CheckedModel
from hotswap.entrypoints.server.sampling import (
    Int64,
    Logprobs,
    N,
    NonNegInt64,
    Seed,
    Stop,
    TokenCount,
    TokenIds,
    TopK,
)

SessionId = Annotated[str, Field(min_length=1, max_length=MAX_SESSION_ID_CHARS)]
KVRetention = Annotated[float, Field(ge=0, le=MAX_KV_RETENTION_S)]  # seconds


class RequestModel(CheckedModel):
    """A request body, validated as vLLM's models validate it: pydantic's lax mode, so a
    body vLLM accepts is accepted here ("logprobs": 1 on chat is true, "n": "2" is 2,
    "stream": "true" is true), and what vLLM refuses is refused ("n": "two", "n": 2.5);
    floats are finite and bounded (CheckedModel), strings valid Unicode.

    Unknown fields: whether they are ignored (the default, as vLLM) or refused
    (--reject-unknown-fields) is a server flag, but pydantic's `extra` is fixed when the
    class is built. So there is one model for both: validation ignores unknown keys
    (extra="ignore": they are never stored, checked or passed on) and records their names
    in `unknown_fields`, nested models' under their field (`stream_options.foo`); the route's
    class then warns or refuses (`params.UnknownFieldsRoute`). Two model variants per request
    would double every class and make each route pick one per request; validating with
    extra="allow" would keep the unknown values in the model and its dumps."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _record_unknown_fields(
        cls, data: Any, handler: ModelWrapValidatorHandler[RequestModel]
    ) -> RequestModel:
        model = handler(data)
        if isinstance(data, dict):
            fields = cls.model_fields
            known = set(fields) | {f.alias for f in fields.values() if f.alias}
            unknown = [str(key) for key in data if key not in known]
            for name in fields:  # nested request models (stream_options) report theirs too
                value = getattr(model, name)
                if isinstance(value, RequestModel):
                    unknown += [f"{name}.{key}" for key in value.unknown_fields]
            model._unknown_fields = tuple(unknown)
        return model

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """The request's fields that no field of this model declares, in body order."""
        return self._unknown_fields


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint."""

    # `json` on the wire (a field named json would shadow pydantic's BaseModel.json)
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class ResponseFormatSchema(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: text, json_object or json_schema."""

    type: str
    json_schema: ResponseFormatSchema | None = None


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: N = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: TokenCount = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # hotswap extensions
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    max_weight_lag: NonNegInt64 | None = None
    # with --enable-bf16-logprobs: each output token's logprob under the bf16 weights
    return_bf16_logprobs: bool = False
    # vLLM's extensions; ranges are SamplingParams' (400 naming the field)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    prompt_logprobs: Logprobs | None = None
    # vLLM's per-request prefix-cache salt: only requests with the same salt share blocks
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # hotswap: the session the request belongs to, for clients that cannot set the
    # X-Session-ID header (--dp-routing keeps a session's turns on one rank)
    session_id: SessionId | None = None
    # hotswap: keep this request's KV that long after it finishes, for the session's next
    # turn (an agent's tool call); soft, released by a weight commit (engine/kv_cache.py)
    kv_retention_s: KVRetention = 0.0
    # with --enable-return-routed-experts: skip the first N prompt tokens' experts
    routed_experts_prompt_start: NonNegInt64 = 0
    # SGLang's spelling: sglext.routed_experts, rows from routed_experts_start_len
    return_routed_experts: bool = False
    routed_experts_start_len: Int64 = 0
    # logits controls and structured outputs (vLLM's semantics; params.logits_controls,
    # constraints.structured_outputs_of)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM removed these spellings (0.12) and now ignores them, leaving the output
    # unconstrained; older RL frameworks still send them, so hotswap honours them.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # accepted only at their defaults (see params.check_unsupported)
    length_penalty: float | None = None
    use_beam_search: bool = False
    # vLLM's: lower first under --scheduling-policy priority; accepted and unused under the
    # default fcfs, as vLLM's v1 engine does
    priority: Int64 = 0

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: text, list of texts, token ids or list of those."""

    prompt: Any
    max_tokens: TokenCount | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[str] | list[list[int]]:
        return normalize_prompts(value)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    # Free-form objects: a message's keys beyond role and content are neither refused nor
    # logged (vLLM ignores the ones it does not know silently); they reach the chat
    # template, which uses what it knows (tool_calls, reasoning_content, ...).
    messages: list[dict[str, Any]]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: image processor settings
    documents: list[dict[str, Any]] | None = None
    # tool calling (chat_tools): tools reach the chat template; "auto" needs a tool parser
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True
    reasoning_effort: str | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> list[dict[str, Any]]:
        return normalize_messages(value)


class TokenizeRequest(RequestModel):
    """POST /tokenize: `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as /v1/chat/completions renders them
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> list[dict[str, Any]] | None:
        return None if value is None else normalize_messages(value)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


# vLLM's type for `prompt`, validated laxly as vLLM does (["1", 2] is the ids [1, 2])
_PROMPT_TYPE = TypeAdapter(list[int] | list[list[int]] | str | list[str])


def normalize_prompts(value: Any) -> list[str] | list[list[int]]:
    """A list of text prompts or a list of token-id prompts (never empty)."""
    if isinstance(value, list):
        with contextlib.suppress(ValidationError):  # else refused below, with hotswap's words
            value = _PROMPT_TYPE.validate_python(value)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, token ids or lists of token ids")
    if all(isinstance(p, str) for p in value):
        return value
    if _is_token_ids(value):
        return [value]
    if all(_is_token_ids(p) for p in value):
        if any(not p for p in value):
            raise ValueError("a token-id prompt must contain at least one token")
        return value
    raise ValueError("must be a string, a list of strings, token ids or lists of token ids")


def normalize_messages(value: Any) -> list[dict[str, Any]]:
    """Messages with `content` as a string (text parts joined by newlines, as vLLM does)."""
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of messages")
    return [_normalize_message(i, m) for i, m in enumerate(value)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    """Text parts are joined into one string, as vLLM does; a message with images keeps
    its parts in order, each image as {"type": "image", "image_url": {"url": ...}} (the
    type chat templates test for; the server reads the url)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {index}: must be an object with a string 'role'")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return dict(message)
    if not isinstance(content, list):
        raise ValueError(f"message {index}: content must be a string or a list of parts")
    parts = [_normalize_part(index, part) for part in content]
    if any(part["type"] == "image" for part in parts):
        return {**message, "content": parts}
    return {**message, "content": "\n".join(part["text"] for part in parts)}


def _normalize_part(index: int, part: Any) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind == "text" and "text" in part:
        return {"type": "text", "text": str(part["text"])}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError(f"message {index}: an image_url part needs image_url.url, a string")
        return {"type": "image", "image_url": {"url": url}}
    raise ValueError(
        f"message {index}: content part of type {kind!r} is not supported (text, image_url)"
    )
