"""Response models of the OpenAI-compatible API (vLLM's shapes, hotswap's extensions
such as `weight_versions` added where vLLM has no field of that name)."""

from __future__ import annotations

import base64
import io
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from hotswap.outputs import RequestOutput


class ResponseModel(BaseModel):
    """Serializes every field, except that the optional extensions named in `omit_if_none`
    are left out while unset (so `token_ids` appears only with `return_token_ids`)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_unset_extensions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in self.omit_if_none:
            if data.get(key, 0) is None:
                del data[key]
        return data


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    omit_if_none = frozenset({"prompt_tokens_details"})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class WeightVersionSpanInfo(ResponseModel):
    """With a LoRA adapter: its name and loaded version (the base model: omitted)."""

    omit_if_none = frozenset({"lora_name", "lora_version"})
    version: int
    label: str
    start: int
    end: int
    stale: bool = False
    lora_name: str | None = None
    lora_version: int | None = None


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extend(self, other: CompletionLogProbs) -> CompletionLogProbs:
        """Append `other`'s tokens (their offsets are already absolute); returns self."""
        self.text_offset += other.text_offset
        self.token_logprobs += other.token_logprobs
        self.tokens += other.tokens
        self.top_logprobs += other.top_logprobs
        return self


class PromptLogprob(ResponseModel):
    """vLLM's Logprob as it serialises in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(ResponseModel):
    """A choice of a completion response, or of one stream chunk."""

    omit_if_none = frozenset({"token_ids", "prompt_token_ids", "prompt_logprobs", "bf16_logprobs"})
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpanInfo] = Field(default_factory=list)
    routed_experts: str | None = None  # encode_routed_experts; null: none (as vLLM)
    # return_bf16_logprobs (hotswap): on the final output, each output token's raw logprob
    # under the bf16 weights of an FP8 engine (engine/scoring.py)
    bf16_logprobs: list[float] | None = None


class CompletionStreamChoice(CompletionChoice):
    """A choice of a stream chunk: vLLM's stream choices have no `routed_experts`."""

    omit_if_none = CompletionChoice.omit_if_none | {"routed_experts"}


class CompletionResponse(ResponseModel):
    """A completion, or (object `text_completion` too, as OpenAI does) one stream chunk."""

    omit_if_none = frozenset({"usage", "sglext"})
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    sglext: dict[str, Any] | None = None  # SGLang's extensions (sglext_of)


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None
    refusal: list[ChatLogProbsContent] | None = None


class ChatMessage(ResponseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: str | None = None  # vLLM 0.32's field for the thinking (--reasoning-parser)


class DeltaMessage(ResponseModel):
    """A stream delta: only what this chunk adds (vLLM's exclude_unset shape)."""

    omit_if_none = frozenset({"role", "content", "reasoning", "tool_calls"})
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(ResponseModel):
    omit_if_none = frozenset({"token_ids", "bf16_logprobs"})
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpanInfo] = Field(default_factory=list)
    routed_experts: str | None = None  # encode_routed_experts
    # return_bf16_logprobs (hotswap): on the final output, each output token's raw logprob
    # under the bf16 weights of an FP8 engine (engine/scoring.py)
    bf16_logprobs: list[float] | None = None


def encode_routed_experts(rows: np.ndarray | None) -> str | None:
    """vLLM's encoding of a choice's routed experts: base64 of the array's `.npy` bytes,
    [positions, decoder layers, top_k]; read with np.load(io.BytesIO(b64decode(text)))."""
    if rows is None:
        return None
    with io.BytesIO() as buffer:
        np.save(buffer, rows, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def sglang_routed_experts(rows: np.ndarray) -> str:
    """SGLang's encoding: base64 of the int32 ids, flat in [positions, layers, top_k] order
    (no header: the reader reshapes by the model's layers and top_k). Its layers here are
    the sparse ones: SGLang's buffer also holds (zero) rows for a model's dense layers."""
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode("ascii")


def sglext_of(body: Any, final: RequestOutput) -> dict[str, Any] | None:
    """SGLang's `sglext` for its return_routed_experts (a request field of both OpenAI
    routes): the first choice's experts, in its encoding, as SGLang returns them."""
    rows = final.outputs[0].routed_experts if final.outputs else None
    if not getattr(body, "return_routed_experts", False) or rows is None:
        return None
    return {"routed_experts": sglang_routed_experts(rows)}


class ChatStreamChoice(ResponseModel):
    omit_if_none = frozenset({"token_ids", "bf16_logprobs"})
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpanInfo] = Field(default_factory=list)
    bf16_logprobs: list[float] | None = None  # on the final chunk (ChatChoice's)


class ChatCompletionResponse(ResponseModel):
    omit_if_none = frozenset({"prompt_token_ids", "usage", "prompt_logprobs", "sglext"})
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # SGLang's extensions: {"routed_experts": ...} for its return_routed_experts
    sglext: dict[str, Any] | None = None


class ChatCompletionChunk(ResponseModel):
    omit_if_none = frozenset({"prompt_token_ids", "usage"})
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(ResponseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "hotswap"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None  # None on an adapter's card, as vLLM
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(ResponseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    omit_if_none = frozenset({"token_strs"})
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
