"""Mixture-of-experts blocks: a router, experts' weights stacked, an optional shared expert.

Layout (transformers 5's own, so its `state_dict()` names load as they are):
`mlp.gate.weight` [experts, hidden], `mlp.experts.gate_up_proj` [experts, 2 x inter,
hidden] (gate rows, then up rows) and `mlp.experts.down_proj` [experts, hidden, inter].

A step's (token, slot) pairs are sorted by expert once; each expert's rows then run as one
GEMM pair on a view of its weights (no copy), so the Python loop is over the experts a
step hits, never over tokens. Measured against one padded batched matmul over all the
experts in benchmarks/moe.py.

Under tensor parallelism (vLLM's layout) every rank holds every expert, but only its share
of each one's intermediate dimension (gate_up_proj [experts, 2 x inter / ranks, hidden]:
its gate rows, then its up rows; down_proj [experts, hidden, inter / ranks]); the router is
whole on every rank, so every rank routes alike. Each rank's block output is a partial sum,
summed across the ranks once at the block's end.

Under expert parallelism (`--enable-expert-parallel`, vLLM's flag) rank r holds experts
[r E / ranks, (r + 1) E / ranks) whole instead. Every rank has every token (attention's
output is all-reduced before the block), routes them alike, runs the pairs routed to its
own experts and skips the others (their id becomes -1); the same all-reduce at the block's
end sums the ranks' parts. No token is sent anywhere: with tensor-parallel attention the
tokens are already on every rank, which is how vLLM runs expert parallelism without data
parallelism too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.model.kernels import LayerKernels
from hotswap.model.layers import Linear, silu_and_mul, tiled_linear
from hotswap.model.parallel import TPGroup, even_split
from hotswap.model.quantized import Fp8Stack
from hotswap.model.reference_views import serves_reference
from hotswap.quantization.fp8 import Fp8Config

# Rows of one expert that go through the GEMV kernel, bf16 or FP8 (csrc/moe.cpp reads the
# same bound). An expert's matrix is small and the GEMM library's fixed cost per call
# weighs more on it: measured on a [1024 x 1024] expert matrix, the bf16 GEMV takes 46 / 58
# us at 12 / 16 rows where the GEMM library takes 86 / 97 (a dense layer crosses over near
# 12), the FP8 one 61 / 81 where dequantizing and the GEMM library take 86 / 94.
EXPERT_MATVEC_MAX_ROWS = 16


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to one
    shared_expert_size: int  # 0: no shared expert (Qwen2-MoE has one, gated)
    sparse_layers: frozenset[int]  # the others are dense MLPs
    intermediate_key: str = "intermediate_size"  # the config key intermediate_size came from

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_layers: int, *, mixtral: bool = False) -> MoESpec:
        """Mixtral always renormalises (its router has no `norm_topk_prob`); Qwen2/3-MoE
        may keep some layers dense (`mlp_only_layers`, `decoder_sparse_step`), as
        transformers does."""
        try:
            # transformers 5 writes num_local_experts for every family; hub configs of
            # Qwen-MoE and OLMoE say num_experts
            experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
            top_k = int(cfg["num_experts_per_tok"])
            key = "moe_intermediate_size"
            if not cfg.get(key):
                key = "intermediate_size"  # Mixtral's and OLMoE's
            inter = int(cfg[key])
        except KeyError as e:
            raise ValueError(f"config.json: required key {e.args[0]!r} is missing") from None
        if not 1 <= top_k <= experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({top_k}) must be between 1 and the "
                f"number of experts ({experts})"
            )
        dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=inter,
            norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            sparse_layers=sparse,
            intermediate_key=key,
        )


def route(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k]) as transformers'
    routers: softmax in float32 over every expert, top-k (descending), optionally
    renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(nn.Module):
    def __init__(
        self, experts: int, hidden: int, inter: int, dtype: torch.dtype, invariant: bool
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(experts, 2 * inter, hidden, dtype=dtype), False
        )
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype), False)
        self.invariant = invariant
        self.compute_dtype = dtype  # the activations' (the weights' too, unless FP8)
        self.fp8: dict[str, Fp8Stack] | None = None  # set before `kernels` (its setter reads it)
        self.kernels = None  # GEMV and fused activation (LayerKernels) when set
        self.lora: Any = None  # adapter slots (lora/experts.py ExpertLoRA) when LoRA is on

    def quantize(self, config: Fp8Config, name: str, tp: TPGroup) -> None:
        """FP8 storage for both stacked parameters, before any weight is loaded. Each
        expert's gate and up rows must be whole blocks (they share one grid), and so must
        a tensor-parallel rank's share of down's columns (vLLM's rules for FP8 experts)."""
        inter = self.down_proj.shape[2]
        if inter % config.block[0] or (tp.parallel and not tp.expert_parallel
                                       and inter % config.block[1]):  # fmt: skip
            field = "quantization_config.weight_block_size"
            raise InvalidArgument(field, f"{field}: {list(config.block)} does not divide "
                                  f"{name}'s intermediate size on this rank ({inter})")  # fmt: skip
        # FP8 codes in the stacked parameters, their scales beside (`gate_up_proj_scale_inv`,
        # `down_proj_scale_inv`, transformers' names); None: the model dtype
        self.fp8 = {p: Fp8Stack(self, p, config) for p in ("gate_up_proj", "down_proj")}

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over slots j of weights[t, j] * expert_{ids[t, j]}(x[t]), for each token t
        (each expert with the adapter of t's row, if any); an id of -1 adds nothing."""
        fused = self.fused_op()
        adapters = self.lora.active_slots() if self.lora is not None else []
        if fused is not None and not self.invariant and not adapters:  # no host sync
            return self._call_fused(fused, x, ids, weights)
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        # -1: another rank's expert (expert parallelism); those pairs sort first, are skipped
        counts = torch.bincount(flat + 1, minlength=self.gate_up_proj.shape[0] + 1).tolist()
        skipped, counts = counts[0], counts[1:]
        order = order[skipped:]
        hit = [expert for expert, n in enumerate(counts) if n]
        if not hit:  # every pair on another rank's experts (a decode step under EP)
            return x.new_zeros((tokens, self.down_proj.shape[1]))
        sizes = [counts[expert] for expert in hit]
        rows = x.index_select(0, order // top_k)
        # Two passes over the experts hit, the activation once between them: per expert
        # only its two products run from Python (decode hits many experts with 1-2 rows).
        gate_up = torch.cat([self._linear(segment, "gate_up_proj", expert)
                             for segment, expert in zip(rows.split(sizes), hit)])  # fmt: skip
        if adapters:  # each grouped row's token and expert, by adapter
            groups = self.lora.group(order // top_k, flat[order], tokens, adapters)
            self.lora.add("gate_up_proj", rows, gate_up, groups)
        hidden = self.kernels.silu_and_mul(gate_up) if self.kernels else silu_and_mul(gate_up)
        grouped = torch.cat([self._linear(segment, "down_proj", expert)
                             for segment, expert in zip(hidden.split(sizes), hit)])  # fmt: skip
        if adapters:
            self.lora.add("down_proj", hidden, grouped, groups)
        if skipped:  # other ranks' pairs add nothing
            out = grouped.new_zeros((tokens * top_k, grouped.shape[1]))
        else:
            out = torch.empty_like(grouped)
        out[order] = grouped  # back to (token, slot) order
        return mix_slots(out.view(tokens, top_k, -1), weights).to(x.dtype)

    @property
    def kernels(self) -> LayerKernels | None:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: LayerKernels | None) -> None:
        self._kernels = kernels
        for stack in (self.fp8 or {}).values():
            stack.fp8.kernels = kernels

    def fused_op(self):  # noqa: ANN202 - an op, or None
        """The kernel that runs the step's experts in one call over this layer's weights
        (their dtype's), if there is one here."""
        if self.kernels is None:
            return None
        if self.fp8 is None or serves_reference(self.fp8["gate_up_proj"].fp8):
            return self.kernels.fused_moe
        return self.kernels.fused_moe_fp8

    def dense_weight(self, parameter: str) -> torch.Tensor | None:
        """Stacked `parameter` in the model dtype: the parameter itself, or inside
        serving_reference (model/reference.py) an FP8 stack's reference, run as bf16
        weights are; None: FP8 codes, run as such."""
        if self.fp8 is None:
            return getattr(self, parameter)
        layout = self.fp8[parameter].fp8
        return layout.reference if serves_reference(layout) else None

    def _call_fused(self, op, x: torch.Tensor, ids: torch.Tensor,  # noqa: ANN001
                    weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        gate_up = self.dense_weight("gate_up_proj")
        if gate_up is not None:
            return op(x, gate_up, self.dense_weight("down_proj"), ids, weights)
        up, down = self.fp8["gate_up_proj"], self.fp8["down_proj"]
        return op(x, up.weight, up.weight_scale_inv, down.weight, down.weight_scale_inv, ids,
                  weights, up.fp8.block[0], up.fp8.block[1])  # fmt: skip

    def _linear(self, x: torch.Tensor, parameter: str, expert: int) -> torch.Tensor:
        """x through expert `expert`'s `parameter` (gate_up_proj or down_proj)."""
        stacked = self.dense_weight(parameter)
        if stacked is None:
            invariant = tiled_linear if self.invariant else None
            return self.fp8[parameter].linear(x, expert, invariant, EXPERT_MATVEC_MAX_ROWS)
        weight = stacked[expert]
        if self.invariant:
            return tiled_linear(x, weight, None)
        matvec = self.kernels.gemv if self.kernels is not None else None
        small = x.shape[0] <= EXPERT_MATVEC_MAX_ROWS
        if matvec is not None and weight.dtype == torch.bfloat16 and small:
            return matvec(x, weight)
        return F.linear(x, weight)


def mix_slots(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over slots j of weights[t, j] * out[t, j] in float32, one slot after another in
    slot order, as the CPU kernel sums them (torch's sum over the slot dimension picks its
    order by shape): a token's result is the same for any batch around it."""
    slots = out.float().unbind(1)
    mixed = slots[0] * weights[:, :1]
    for j in range(1, len(slots)):
        mixed = mixed + slots[j] * weights[:, j : j + 1]
    return mixed


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert behind a sigmoid gate.
    `last_expert_ids` holds the experts of the last forward's tokens [tokens, top_k],
    for routing replay (read by the runner after the step; never copied otherwise).
    Under tensor parallelism `shared_expert` must leave its output unreduced (a partial sum,
    as the routed experts'): the block sums both, then reduces once."""

    def __init__(
        self,
        spec: MoESpec,
        hidden: int,
        dtype: torch.dtype,
        invariant: bool,
        shared_expert: nn.Module | None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.top_k, self.normalise = spec.top_k, spec.norm_topk_prob
        self.gate = Linear(hidden, spec.num_experts, False, dtype, invariant)
        # expert parallelism: a range of whole experts here; else every expert, its share
        self.expert_range = expert_range(spec.num_experts, tp)
        if self.expert_range is None:
            count = spec.num_experts
            inter = even_split(spec.intermediate_size, tp.size, tp.rank, spec.intermediate_key)[1]
        else:
            count, inter = self.expert_range[1], spec.intermediate_size
        self.experts = FusedExperts(count, hidden, inter, dtype, invariant)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden, 1, False, dtype, invariant)
        self.last_expert_ids: torch.Tensor | None = None
        self.reduce = tp if tp.parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalise)
        self.last_expert_ids = ids
        out = self.experts(x, self._local(ids), weights)
        if self.shared_expert is not None:
            # the gate (whole on every rank) scales each rank's partial sum: the sum of
            # the scaled partials is the scaled sum
            out = out + row_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce is not None:
            out = self.reduce.all_reduce(out)  # in place: `out` is this forward's own
        return out

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids of this rank's experts among its own; -1 for another rank's (each rank
        adds its experts' share, the block's all-reduce sums them)."""
        if self.expert_range is None:
            return ids
        first, count = self.expert_range
        local = ids - first
        return torch.where((local >= 0) & (local < count), local, -1)


def expert_range(num_experts: int, tp: TPGroup) -> tuple[int, int] | None:
    """(first, count) of the routed experts this rank holds whole under expert
    parallelism; None without it (every rank holds every expert's share)."""
    if not tp.expert_parallel:
        return None
    return even_split(num_experts, tp.size, tp.rank, "num_experts")


def row_sigmoid(logit: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [tokens, 1] column, as the softmax of each row's (logit, 0). torch's
    elementwise kernels round exp differently in their vector body and their scalar tail,
    and which elements fall in the tail depends on the number of tokens: a row's gate
    would then depend on the batch around it. Softmax runs row by row (within 1e-7 of
    torch.sigmoid)."""
    return torch.softmax(torch.cat([logit, torch.zeros_like(logit)], dim=-1), dim=-1)[:, :1]
