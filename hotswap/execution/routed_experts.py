"""Rollout routing replay: the experts each token was routed to, per decoder layer, kept
beside its KV. Rows cover every decoder layer, as vLLM's and SGLang's do; a dense layer's
row stays zero.

Every computed token writes its experts [layers, top_k] at its KV slot, in the same
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
    """vLLM's encoding: uint8 up to 256 experts, uint16 beyond."""
    return np.dtype(np.uint8 if num_experts <= 1 << 8 else np.uint16)


class RoutedExpertsBuffer:
    def __init__(
        self,
        num_slots: int,
        layers: int,
        sparse_layers: list[int],
        top_k: int,
        num_experts: int,
        device: torch.device,
    ) -> None:
        # int16 holds any model's expert ids (at most 32767 experts; the largest have 384)
        self.slots = torch.zeros(num_slots, layers, top_k, dtype=torch.int16, device=device)
        self.sparse = torch.tensor(sorted(sparse_layers), dtype=torch.long, device=device)
        self.every_layer = len(sparse_layers) == layers
        self.dtype = expert_dtype(num_experts)

    def record(self, slot_mapping: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """A step's experts [tokens, sparse layers, top_k], at the tokens' KV slots."""
        ids = expert_ids.to(torch.int16)
        if self.every_layer:
            self.slots[slot_mapping] = ids
        else:  # dense layers' columns are never written: zero, as vLLM's and SGLang's
            self.slots[slot_mapping[:, None], self.sparse[None, :]] = ids

    def read(self, slots: list[int]) -> np.ndarray:
        rows = self.slots[torch.tensor(slots, dtype=torch.long, device=self.slots.device)]
        return rows.cpu().numpy().astype(self.dtype)
