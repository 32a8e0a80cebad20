"""Rollout routing replay: the experts each token was routed to, per mixture-of-experts
layer, kept beside its KV.

Every computed token writes its experts [sparse layers, top_k] at its KV slot, in the same
step as its keys and values. A prefix-cache hit therefore finds the experts of the tokens
it reuses (computed with the same weights: cache hashes are salted with the weight
version), and a request that keeps its KV across a pause and a weight commit keeps the
experts that produced its earlier tokens. A request reads its rows once, in position
order, as soon as they are computed; its blocks may be freed or reused afterwards.
"""

from __future__ import annotations

import numpy as np
import torch


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest of vLLM's encodings (uint8, uint16, int32) holding every expert id."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


class RoutedExpertsBuffer:
    def __init__(
        self, num_slots: int, layers: int, top_k: int, num_experts: int, device: torch.device
    ) -> None:
        # int16 holds any model's expert ids (at most 32767 experts; the largest have 384)
        self.slots = torch.zeros(num_slots, layers, top_k, dtype=torch.int16, device=device)
        self.dtype = expert_dtype(num_experts)

    @property
    def shape(self) -> tuple[int, int]:
        """(sparse layers, top_k) of each token's row."""
        return self.slots.shape[1], self.slots.shape[2]

    def record(self, slot_mapping: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """A step's experts [tokens, layers, top_k], at the tokens' KV slots."""
        self.slots[slot_mapping] = expert_ids.to(torch.int16)

    def read(self, slots: list[int]) -> np.ndarray:
        rows = self.slots[torch.tensor(slots, dtype=torch.long, device=self.slots.device)]
        return rows.cpu().numpy().astype(self.dtype)
