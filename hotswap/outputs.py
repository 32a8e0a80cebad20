"""What generation returns to callers (front-end state, not wire messages)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# vLLM's shape: None for the first prompt token (nothing predicts it), then one dict per
# prompt token holding that token plus the top-k.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class WeightVersionSpan:
    """Output tokens [start, end) were produced by committed weight `version` (`label`).
    `stale`: they attended to KV computed with older weights (pause with clear_cache=False)."""

    version: int
    label: str
    start: int
    end: int
    stale: bool = False
    # The LoRA adapter that produced them (None: the base model) and its loaded version
    # (1 for the first load under that name, +1 per reload).
    lora_name: str | None = None
    lora_version: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    # With --enable-return-routed-experts, on the final output: the experts each position
    # fed to the model was routed to, [prompt + output tokens - 1 -
    # routed_experts_prompt_start, decoder layers, top_k] (vLLM's field and shape)
    routed_experts: np.ndarray | None = None
    # With return_bf16_logprobs (--enable-bf16-logprobs), on the final output: each token
    # of `token_ids`' raw logprob under the unquantized (bf16) weights of an FP8 engine
    bf16_logprobs: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_versions(self) -> list[int]:
        """The committed weight version of each token in `token_ids` (the spans, unrolled:
        what AReaL-style trainers consume per token)."""
        if not self.weight_versions:
            return []
        offset = self.weight_versions[0].start  # delta outputs: spans index the whole output
        versions = [0] * len(self.token_ids)
        for span in self.weight_versions:
            versions[span.start - offset : span.end - offset] = [span.version] * (
                span.end - span.start
            )
        return versions


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams(prompt_logprobs=k)
