"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (a gated shared expert), Mixtral and
OLMoE. Attention is the Llama family's; the feed-forward blocks are model/moe.py's.

Checkpoints name each expert's projections apart (`mlp.experts.3.gate_proj.weight`;
Mixtral: `block_sparse_moe.experts.3.w1.weight`); they load into the stacked parameters
as shards `(expert, part)`, one expected key each, so a round may update some experts
only. transformers 5's own stacked names (`mlp.experts.gate_up_proj`) load whole.

Tensor parallelism splits each expert's intermediate dimension (sharding.py, model/moe.py).
A rank's share of a stacked gate_up_proj is then two ranges (its gate rows, its up rows):
it loads as two halves, shards `(None, part)` (every expert's gate or up rows), each one
slice; what needs one slice of the whole tensor (m2n's parts, sparse deltas) refuses it.
OLMoE normalises q and k over every head at once: under tensor parallelism each rank's
norm weights are its heads' part, and the sums of squares are summed across the ranks
(decoder.py `Attention._whole_norms`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from hotswap.model.models.decoder import MLP
from hotswap.model.models.llama import LlamaForCausalLM
from hotswap.model.moe import FusedExperts, MoESpec, SparseMoeBlock, expert_range
from hotswap.model.parallel import ShardSlice, check_whole_shape
from hotswap.model.quantized import SCALE_NAME, codes_of_scale, scale_name_of
from hotswap.quantization.fp8 import Fp8Config

_EXPERT_TENSOR = re.compile(
    r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<kind>weight|weight_scale_inv)$"
)
# projection -> (stacked parameter, part: gate 0 / up 1 of gate_up_proj; None: down_proj)
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None), "w2": ("down_proj", None),
}  # fmt: skip
_STACKED_PARAMETERS = ("gate_up_proj", "down_proj")
_STACKED = tuple(f".mlp.experts.{p}" for p in _STACKED_PARAMETERS)


class MoeForCausalLM(LlamaForCausalLM):
    mixtral = False  # Mixtral's config keys and checkpoint names

    def read_config(self, hf_config: dict[str, Any]) -> None:
        if self.mixtral and hf_config.get("sliding_window") is not None:
            raise ValueError("config.json: sliding_window attention is not supported")
        self.moe = MoESpec.from_hf(hf_config, self.spec.num_layers, mixtral=self.mixtral)

    def make_mlp(self, layer: int, dtype: torch.dtype, invariant: bool) -> nn.Module:
        if layer not in self.moe.sparse_layers:
            return MLP(self.spec, dtype, invariant, tp=self.tp)
        shared = self.moe.shared_expert_size
        shared_expert = None
        if shared:
            # split as a dense MLP, its partial sum reduced with the routed experts' (no
            # MoE family here has MLP biases, which a partial sum would add once per rank)
            shared_expert = MLP(self.spec, dtype, invariant, shared, self.tp,
                                "shared_expert_intermediate_size", reduce=False)  # fmt: skip
        return SparseMoeBlock(
            self.moe, self.spec.hidden_size, dtype, invariant, shared_expert, self.tp
        )

    def quantize(self, config: Fp8Config) -> None:
        """The linear layers as a dense model's, and the routed experts where `config`
        quantizes them (model/moe.py FusedExperts.quantize)."""
        super().quantize(config)
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts) and config.quantizes(name):
                module.quantize(config, name, self.tp)
        self._parameter_index = self._expected_keys = None

    def quantized_layer(self, param_name: str) -> Any:
        """As a dense model's, and the FP8 storage of a stacked experts' parameter."""
        owner, _, stacked = param_name.rpartition(".")
        if owner.endswith(".mlp.experts") and stacked in _STACKED_PARAMETERS:
            fp8 = self.get_submodule(owner).fp8
            return None if fp8 is None else fp8[stacked]
        return super().quantized_layer(param_name)

    @property
    def graphable(self) -> bool:
        """Whether decode steps may run as one graph (compiled on the CPU, a CUDA graph on
        the GPU): where the routed experts run in one fused kernel call, which reads
        nothing back (not in batch-invariant mode). Otherwise routing is data-dependent
        (the experts hit are read back to pick the products to run): steps run eagerly."""
        experts = [block.experts for block in self.sparse_blocks()]
        return all(e.fused_op() is not None and not e.invariant for e in experts)

    @property
    def compilable(self) -> bool:
        return self.graphable

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def routed_expert_ids(self) -> torch.Tensor:
        """The experts the last forward chose: [tokens, sparse layers, top_k]."""
        return torch.stack([block.last_expert_ids for block in self.sparse_blocks()], dim=1)

    # -- checkpoint names -----------------------------------------------------------------
    def _map_name(self, name: str) -> tuple[str, Any] | None:
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return super()._map_name(name.replace(".block_sparse_moe.", ".mlp."))
        expert = int(match["expert"])
        if expert >= self.moe.num_experts:
            raise ValueError(
                f"weights: unknown parameter {name!r} (the model has {self.moe.num_experts} "
                f"experts per layer)"
            )
        if expert not in self.local_experts():
            return None  # another rank's expert (expert parallelism): not loaded here
        stacked, part = _PROJECTIONS[match["proj"]]
        name = f"{match['layer']}.mlp.experts.{stacked}"
        if match["kind"] == SCALE_NAME:  # an FP8 checkpoint's scales of the expert's codes
            name = scale_name_of(name)
        return name, (expert, part)

    def local_experts(self) -> range:
        """The routed experts whose weights this rank holds (their global indices): all of
        them, each split, without expert parallelism; a range of whole ones with it."""
        span = expert_range(self.moe.num_experts, self.tp)
        return range(self.moe.num_experts) if span is None else range(span[0], sum(span))

    @staticmethod
    def _key(param_name: str, shard: Any) -> str:
        if isinstance(shard, tuple):
            expert, part = shard
            return f"{param_name}#{expert}" + ("" if part is None else f".{part}")
        return LlamaForCausalLM._key(param_name, shard)

    def _shard_view(self, param: torch.Tensor, name: str, shard: Any) -> torch.Tensor:
        if not isinstance(shard, tuple):
            return super()._shard_view(param, name, shard)
        expert, part = shard  # expert None: every expert's (a stacked tensor's half)
        weight = param.data if expert is None else param.data[expert - self.local_experts().start]
        if part is None:
            return weight
        dim = weight.dim() - 2  # the rows: gate, then up
        size = weight.shape[dim] // 2
        return weight.narrow(dim, part * size, size)

    # -- a stacked gate_up_proj under tensor parallelism ----------------------------------
    def _halved(self, name: str) -> str | None:
        """The parameter checkpoint tensor `name` loads into if it is a stacked gate_up_proj
        whole under tensor parallelism (a rank holds two ranges of it, its gate rows and its
        up rows, written as two halves); else None."""
        if not self.tp.parallel or self.tp.expert_parallel:  # whole experts: one slice
            return None
        target = self._map_name(name)
        if target is None or target[1] is not None or not target[0].endswith(_STACKED[0]):
            return None
        return target[0] if target[0] in self.parameter_index() else None

    def _load_one(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        target: tuple[str, Any],
        tensor: torch.Tensor,
    ) -> set[str]:
        stacked = self._halved(name)
        if stacked is None:
            return super()._load_one(params, name, target, tensor)
        check_whole_shape(name, tensor, self.checkpoint_shape(name))
        half = tensor.shape[1] // 2
        for part in (0, 1):  # [experts, inter, hidden] each: one slice of rows per half
            gate_or_up = tensor.narrow(1, part * half, half)
            super()._load_one(params, name, (stacked, (None, part)), gate_or_up)
        return {self._key(stacked, None)}  # the whole stacked tensor: every expert's parts

    def checkpoint_view(self, name: str) -> tuple[str, torch.Tensor] | None:
        stacked = self._halved(name)
        if stacked is None:
            return super().checkpoint_view(name)
        # where the tensor's two halves are written (`checkpoint_slice` refuses it)
        return self._key(stacked, None), self.parameter_index()[stacked].data

    def checkpoint_slice(self, name: str) -> ShardSlice | None:
        stacked = self._halved(name)
        if stacked is None:
            return super().checkpoint_slice(name)
        # m2n's parts and sparse deltas need this rank's share as one slice of the tensor
        gate, up = (self.checkpoint_name(f"{stacked}#0.{part}") for part in (0, 1))
        raise ValueError(
            f"weights: {name!r} stacks every expert's gate and up rows: a tensor-parallel "
            f"rank holds two ranges of it, which no single slice gives; send each expert's "
            f"gate and up projections as their own tensors (per-expert names: {gate!r}, "
            f"{up!r}, ...)"
        )

    def checkpoint_shape(self, name: str) -> tuple[int, ...] | None:
        stacked = self._halved(name)
        if stacked is None:
            return super().checkpoint_shape(name)
        experts, rows, hidden = self.parameter_index()[stacked].shape
        return experts, rows * self.tp.size, hidden

    def _list_expected_keys(self) -> set[str]:
        return self.expand_keys(super()._list_expected_keys())

    def expand_keys(self, keys: set[str]) -> set[str]:
        expanded = set()
        for key in keys:
            stacked = codes_of_scale(key) or key  # an FP8 model's scales expand as its codes
            if stacked.endswith(_STACKED[0]):
                expanded.update(f"{key}#{e}.{p}" for e in self.local_experts()
                                for p in (0, 1))  # fmt: skip
            elif stacked.endswith(_STACKED[1]):
                expanded.update(f"{key}#{e}" for e in self.local_experts())
            else:
                expanded.add(key)
        return expanded

    def checkpoint_name(self, key: str) -> str:
        name, _, shard = key.partition("#")
        codes = codes_of_scale(name)
        if codes is not None:  # an FP8 weight's scales: named after its codes
            return scale_name_of(self.checkpoint_name(f"{codes}#{shard}"))
        if name.endswith(_STACKED):
            expert, _, part = shard.partition(".")
            layer, stacked = name.rsplit(".mlp.experts.", 1)
            names = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
            proj = names[2] if stacked == "down_proj" else names[int(part)]
            block = "block_sparse_moe" if self.mixtral else "mlp"
            return f"{layer}.{block}.experts.{expert}.{proj}.weight"
        found = super().checkpoint_name(key)
        return found.replace(".mlp.", ".block_sparse_moe.") if self.mixtral else found


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True
    o_bias = False


class MixtralForCausalLM(MoeForCausalLM):
    mixtral = True


class OlmoeForCausalLM(MoeForCausalLM):
    qk_norm = True
    qk_norm_per_head = False  # q and k normalised whole, before the heads are split
