"""LoRA on a mixture of experts' routed experts: peft's `target_parameters` adapters on
the stacked `mlp.experts.gate_up_proj` [experts, 2 x inter, hidden] and
`mlp.experts.down_proj` [experts, hidden, inter] (transformers 5's layout, the model's).

peft's layout (`lora.ParamWrapper` on a 3-D parameter stored [experts, out, in]):
`lora_A` [r x experts, in] holds expert e's A in rows e*r .. (e+1)*r; `lora_B`
[out, r x experts] holds the experts interleaved, column k*experts + e being column k of
expert e's B; expert e's weight becomes W[e] + scaling * B_e @ A_e. Two parameters of one
module are two nested wrappers, so one spells its keys `experts.lora_A.weight` and the
other `experts.base_layer.lora_A.weight`; which is which follows the wrapping order, so
each pair is told apart by its shapes (the two pairs' shapes always differ: they would
need hidden = inter = 2 x inter).

Applied per (token, expert) pair inside the experts' block, before the activation for
gate/up and before the slots are mixed for down: each adapter's pairs, grouped by expert
once per block (both projections read the grouping; each row's slot is made once per
step), run as two batched products (shrink, expand) per projection, padded to the
busiest expert's count, and are added to the base products' rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.errors import InvalidArgument
from hotswap.lora.files import WEIGHTS_FILE

# The stacked parameters an adapter may target, and their (out, in) dims in the model's
# [experts, out, in] layout, as names of FusedExperts' sizes.
PARAMETERS = ("gate_up_proj", "down_proj")
_EXPERTS = re.compile(r"(?P<experts>.+\.experts)(?:\.base_layer)*")

# projection -> {"gate_up_proj": (A [experts, r, in], B [experts, out, r] scaled)}
ExpertMatrices = dict[str, tuple[torch.Tensor, torch.Tensor]]


def parse_target_parameters(value: Any, field: str, where: str) -> tuple[str, ...]:
    """peft's `target_parameters`: each entry names a stacked expert parameter (its last
    segment `gate_up_proj` or `down_proj`, e.g. `mlp.experts.gate_up_proj`)."""
    if value in (None, []):
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidArgument(field, f"{where}: target_parameters must be a list of names")
    unknown = [v for v in value if v.rsplit(".", 1)[-1] not in PARAMETERS]
    if unknown:
        raise InvalidArgument(
            field, f"{where}: target_parameters {unknown} are not supported (a mixture of "
            "experts' stacked mlp.experts.gate_up_proj and mlp.experts.down_proj are)"
        )  # fmt: skip
    return tuple(value)


def is_expert_module(module: str) -> bool:
    """Whether a PEFT module name (`model.layers.0.mlp.experts.base_layer`) is a routed
    experts' wrapper."""
    return _EXPERTS.fullmatch(module) is not None


def build_expert_layers(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], config: Any, model: Any,
    dtype: torch.dtype, max_rank: int,
) -> dict[str, ExpertMatrices]:  # fmt: skip
    """{the model's experts module: {parameter: (A [experts, r, in], B [experts, out, r]
    times the scaling)}}; InvalidArgument (`lora_path`) naming the tensor or setting at
    fault."""
    if not config.target_parameters:
        module = next(iter(pairs))
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module} adapts routed experts "
                              "but adapter_config.json has no target_parameters")  # fmt: skip
    layers: dict[str, ExpertMatrices] = {}
    for module, (a, b) in sorted(pairs.items()):
        name = _EXPERTS.fullmatch(module)["experts"].replace(".block_sparse_moe.", ".mlp.")
        _experts_of(model, name, module)
        count = model.moe.num_experts  # an adapter holds every expert (the rank: some)
        parameter = _which_parameter(module, a, b, count, whole_shapes(model))
        if parameter in layers.setdefault(name, {}):
            raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module}: two adapters on "
                                  f"{name}.{parameter}")  # fmt: skip
        rank = a.shape[0] // count
        if rank > max_rank:
            raise InvalidArgument(
                "lora_path", f"{WEIGHTS_FILE}: {module}.lora_A: r = {rank} per expert "
                f"exceeds adapter_config.json's r ({max_rank})"
            )  # fmt: skip
        scaling = config.scaling_for(name, rank)
        a3 = a.reshape(count, rank, -1)
        b3 = b.reshape(b.shape[0], rank, count).permute(2, 0, 1)
        layers[name][parameter] = (a3.to(dtype).contiguous(),
                                   (b3.float() * scaling).to(dtype).contiguous())  # fmt: skip
    return layers


def _experts_of(model: Any, name: str, module: str) -> Any:
    from hotswap.model.moe import FusedExperts

    blocks = getattr(model, "sparse_blocks", None)
    if blocks is None or not blocks():
        raise InvalidArgument("lora_path", "adapter_config.json: target_parameters: this "
                              "model has no routed experts (not a mixture of experts)")  # fmt: skip
    try:
        experts = model.get_submodule(name)
    except AttributeError:
        experts = None
    if not isinstance(experts, FusedExperts):
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module} is not a mixture of "
                              "experts' routed experts of this model")  # fmt: skip
    return experts


def whole_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each stacked parameter per expert, whole (a tensor-parallel rank
    holds a share of the intermediate dimension; an adapter is sent whole)."""
    hidden, inter = model.spec.hidden_size, model.moe.intermediate_size
    return {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def _which_parameter(module: str, a: torch.Tensor, b: torch.Tensor, count: int,
                     shapes: dict[str, tuple[int, int]]) -> str:  # fmt: skip
    """The stacked parameter a pair adapts, by its shapes (A [r x experts, in],
    B [out, r x experts]); refused naming the tensor when neither fits."""
    for half, tensor in (("lora_A", a), ("lora_B", b)):
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module}.{half} must be a "
                                  "2-D floating-point tensor")  # fmt: skip
    rows = a.shape[0]
    if rows == 0 or rows % count or b.shape[1] != rows:
        raise InvalidArgument(
            "lora_path", f"{WEIGHTS_FILE}: {module}: lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)} are not r x {count} experts (the model's count) on both sides"
        )  # fmt: skip
    for parameter, (out_features, in_features) in shapes.items():
        if a.shape[1] == in_features and b.shape[0] == out_features:
            return parameter
    raise InvalidArgument(
        "lora_path", f"{WEIGHTS_FILE}: {module}: lora_A {tuple(a.shape)} and lora_B "
        f"{tuple(b.shape)} fit neither stacked parameter (per expert, out x in: {shapes})"
    )  # fmt: skip


def expected_expert_tensors(config: Any, model: Any) -> dict[str, torch.Tensor]:
    """A new adapter's expert tensors, zeros, under the names peft gives them (what a
    weight round creating the adapter must send): one wrapper per targeted parameter of
    each routed experts block, the first in the block's parameter order innermost (its
    keys carry one `.base_layer` per wrapper around it)."""
    targeted = [p for p in PARAMETERS
                if any(t.rsplit(".", 1)[-1] == p for t in config.target_parameters)]  # fmt: skip
    if not targeted:
        return {}
    moe = getattr(model, "moe", None)
    if moe is None:
        raise InvalidArgument("lora_config.target_parameters", "lora_config.target_parameters: "
                              "this model has no routed experts")  # fmt: skip
    tensors = {}
    for layer in sorted(moe.sparse_layers):
        module = f"model.layers.{layer}.mlp.experts"
        rank = config.rank_of(module)
        for i, parameter in enumerate(targeted):
            wrapper = module + ".base_layer" * (len(targeted) - 1 - i)
            out_features, in_features = whole_shapes(model)[parameter]
            tensors[f"{wrapper}.lora_A.weight"] = torch.zeros(rank * moe.num_experts, in_features)
            tensors[f"{wrapper}.lora_B.weight"] = torch.zeros(out_features, rank * moe.num_experts)
    return tensors


@dataclass(frozen=True)
class PairGroups:
    """One adapter slot's (token, expert) pairs of a block's forward, grouped by expert
    and padded to the busiest expert's count."""

    slot: int
    ids: torch.Tensor  # [groups]: each group's expert (this rank's id)
    pairs: torch.Tensor  # [groups, longest]: the grouped pairs (padding repeats the first)
    valid: torch.Tensor  # [groups, longest, 1]: True for a pair, False for padding


class ExpertLoRA:
    """A routed experts block's adapter slots: per slot and parameter, A [experts, rank,
    in] and B [experts, out, rank] (the scaling folded in), zero-padded to max_lora_rank.
    Plain tensors, not parameters (digests and weight rounds never see them).

    Under tensor parallelism (share `rank` of `ranks` of the intermediate dimension) each
    rank holds its share of every expert's intermediate dimension, and of the adapter as
    vLLM splits LoRA: gate_up_proj (column-parallel) its gate and up rows of B, A whole;
    down_proj (row-parallel) its columns of A, B whole, so the ranks' partial products sum
    in the block's all-reduce. Under expert parallelism the rank holds the experts `held`
    (global ids) whole, `ranks` 1: their A and B whole, indexed by local id (a pair routed
    to another rank's expert never reaches `add`), the other ranks adding theirs in the
    same all-reduce."""

    def __init__(self, experts: Any, max_loras: int, max_rank: int, context: Any,
                 held: range, rank: int = 0, ranks: int = 1) -> None:  # fmt: skip
        self.context = context
        self.held = held
        self.rank, self.ranks = rank, ranks
        self.inter = experts.down_proj.shape[2]  # this rank's share of the intermediate
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for parameter in PARAMETERS:
            weight = getattr(experts, parameter)
            count, out_features, in_features = weight.shape
            # the activations' dtype: FP8 experts' codes are not a compute dtype
            shape = dict(dtype=experts.compute_dtype, device=weight.device)
            self.a[parameter] = torch.zeros(max_loras, count, max_rank, in_features, **shape)
            self.b[parameter] = torch.zeros(max_loras, count, out_features, max_rank, **shape)
        self.filled: set[int] = set()  # slots holding an adapter with expert matrices

    def write_slot(self, slot: int, parts: ExpertMatrices) -> None:
        for parameter in PARAMETERS:
            self.a[parameter][slot].zero_()
            self.b[parameter][slot].zero_()
        for parameter, (a, b) in parts.items():
            a, b = self._rank_part(parameter, a, b)
            rank = a.shape[1]
            self.a[parameter][slot, :, :rank].copy_(a)
            self.b[parameter][slot, :, :, :rank].copy_(b)
        (self.filled.add if parts else self.filled.discard)(slot)

    def clear_slot(self, slot: int) -> None:
        self.write_slot(slot, {})

    def _rank_part(self, parameter: str, a: torch.Tensor,
                   b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # whole adapters hold every expert (peft's count); the rank keeps its own
        a, b = a[self.held.start : self.held.stop], b[self.held.start : self.held.stop]
        if self.ranks == 1:
            return a, b
        start, size = self.rank * self.inter, self.inter
        if parameter == "gate_up_proj":  # B [experts, gate rows then up rows, r]
            whole = b.shape[1] // 2
            gate, up = b[:, start : start + size], b[:, whole + start : whole + start + size]
            return a, torch.cat([gate, up], dim=1)
        return a[:, :, start : start + size], b

    def active_slots(self) -> list[int]:
        """The step's slots whose adapter adapts these experts (none: the fused path)."""
        batch = self.context.batch
        if batch is None or not self.filled:
            return []
        return sorted({s.slot for s in batch.segments} & self.filled)

    def group(self, tokens: torch.Tensor, experts: torch.Tensor, rows: int,
              slots: list[int]) -> list[PairGroups]:  # fmt: skip
        """Each adapter slot's pairs grouped by expert, once per block forward (both
        projections read them); `tokens` and `experts` give each pair's row of the step
        (of `rows`) and its expert, pairs in ascending expert order (the block's grouping)."""
        pair_slot = self.context.row_slots(rows, experts.device)[tokens]
        found = []
        for slot in slots:
            chosen = (pair_slot == slot).nonzero().squeeze(1)
            if chosen.numel() == 0:
                continue
            ids, counts = torch.unique_consecutive(experts[chosen], return_counts=True)
            starts = counts.cumsum(0) - counts
            offsets = torch.arange(int(counts.max()), device=experts.device)
            valid = offsets[None, :] < counts[:, None]  # [groups, longest]
            pairs = chosen[torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])]
            found.append(PairGroups(slot, ids, pairs, valid[..., None]))
        return found

    def add(self, parameter: str, x: torch.Tensor, out: torch.Tensor,
            groups: list[PairGroups]) -> None:  # fmt: skip
        """out[p] += B[slot, e] @ A[slot, e] @ x[p] for every pair p of an adapter's row
        (`groups`: from `group`)."""
        for g in groups:
            shrink = torch.bmm(x[g.pairs], self.a[parameter][g.slot][g.ids].transpose(1, 2))
            delta = torch.bmm(shrink, self.b[parameter][g.slot][g.ids].transpose(1, 2))
            delta = delta * g.valid.to(delta.dtype)  # padding adds zeros
            out.index_add_(0, g.pairs.view(-1), delta.view(-1, out.shape[1]))
