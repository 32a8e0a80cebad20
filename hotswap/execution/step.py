"""What the model layer reads from a scheduled step: protocols the engine's `Request`,
`ScheduledRequest` and `SchedulerOutput` satisfy structurally. The engine imports the
model layer, so the model layer names these shapes here instead of importing the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hotswap.lora.adapter import AdapterWeights
from hotswap.multimodal.placement import ImagePlacement
from hotswap.sampling_params import SamplingParams
from hotswap.structured_output import GrammarMatcher


class SamplingRequest(Protocol):
    """What the sampler reads from a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> frozenset[int]: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def grammar(self) -> GrammarMatcher | None: ...


class StepRequest(SamplingRequest, Protocol):
    """What the runner also reads: where the KV goes and the prompt scoring progress."""

    @property
    def block_ids(self) -> list[int]: ...
    @property
    def prompt_logprobs(self) -> list: ...
    @property
    def needs_prompt_logprobs(self) -> bool: ...
    @property
    def lora(self) -> AdapterWeights | None: ...
    @property
    def routed_experts_start(self) -> int: ...
    @property
    def images(self) -> ImagePlacement | None: ...


class ScheduledChunk(Protocol):
    """Tokens [start, start + num_tokens) of a request run this step; `samples`: the
    chunk reaches the last known token, so its last row is sampled."""

    @property
    def request(self) -> StepRequest: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def samples(self) -> bool: ...


class StepPlan(Protocol):
    @property
    def scheduled(self) -> Sequence[ScheduledChunk]: ...
