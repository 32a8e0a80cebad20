"""Mixture-of-experts checkpoints for tests: per-expert tensors restacked under transformers
5's names (`mlp.experts.gate_up_proj` [experts, 2 x inter, hidden], gate rows then up rows;
`mlp.experts.down_proj` [experts, hidden, inter]), what a trainer holding a transformers 5
model sends; and the experts transformers' router chooses (`router_top_k`), the reference
for routing replay."""

from __future__ import annotations

import re

import numpy as np
import torch

_EXPERT = re.compile(
    r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>\w+)\.weight$"
)
# each projection's names: Qwen-MoE's, then Mixtral's
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every layer's per-expert tensors replaced by its two stacked ones
    (Mixtral's `block_sparse_moe` named `mlp`, as transformers 5 does); the rest as is."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            layers.setdefault(match["layer"], {})[(int(match["expert"]), match["proj"])] = tensor
    for layer, parts in layers.items():
        experts = range(1 + max(expert for expert, _ in parts))

        def part(expert: int, names: tuple[str, str]) -> torch.Tensor:
            return next(parts[(expert, n)] for n in names if (expert, n) in parts)  # noqa: B023

        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([part(e, _GATE), part(e, _UP)]) for e in experts]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([part(e, _DOWN) for e in experts])
    return out


def router_top_k(model, router_logits, length: int) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """From a transformers mixture of experts and the router logits of one forward over
    `length` positions: the router probabilities [positions, decoder layers, experts]
    and their top-k [positions, decoder layers, top_k] (dense layers: zero rows)."""
    top_k = model.config.num_experts_per_tok
    layers = model.model.layers
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
    probs = torch.zeros(length, len(layers), router_logits[0].shape[-1])
    for layer, r in zip(sparse, router_logits, strict=True):
        probs[:, layer] = torch.softmax(r.float(), dim=-1)
    rows = torch.topk(probs, top_k, dim=-1).indices
    rows[:, [i for i in range(len(layers)) if i not in sparse]] = 0
    return probs.numpy(), rows.numpy()
