"""Test probe: records the logits each request was sampled from, step by step."""

from __future__ import annotations

from collections import defaultdict

import torch

from hotswap.execution.sampler import Sampler, SamplingBatch


class RecordingSampler(Sampler):
    def __init__(self, inner: Sampler) -> None:
        self.generator = inner.generator
        self.logprobs_mode = inner.logprobs_mode
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch):  # noqa: ANN204
        result = super().__call__(logits, batch)
        # Recorded after the call: includes the in-place min_tokens suppression and penalties.
        for row, request in enumerate(batch.requests):
            self.logits[request.request_id].append(logits[row].clone())
        return result


def record_logits(llm) -> RecordingSampler:  # noqa: ANN001
    runner = llm.engine.runner
    runner.sampler = RecordingSampler(runner.sampler)
    return runner.sampler
