"""How a decoder's parameters split over tensor-parallel ranks, as vLLM lays them out:
q/k/v by heads and gate/up by columns (column-parallel), o/down by their input columns
(row-parallel: each rank's partial product is summed across ranks), the embedding and
the LM head by vocabulary rows (padded to a multiple of the ranks; logits gathered).
Norms and the biases of row-parallel layers are whole on every rank. Mixture-of-experts
blocks keep every expert on every rank, each split as a dense MLP (its gate/up rows, its
down_proj columns); routers are whole on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotswap.model.models.spec import DecoderSpec
from hotswap.model.parallel import HeadLayout, ShardSlice, TPGroup, even_split


def vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first row, real rows, allocated rows) of this rank's share of the vocabulary: every
    rank allocates the same number of rows, the last one's tail is padding."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def vocab_embedding(
    ids: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup
) -> torch.Tensor:
    """The embedding of `ids` from this rank's rows, summed across ranks (each id's row
    lives on one rank; the others contribute zeros, so the sum is exact)."""
    if not tp.parallel:
        return F.embedding(ids, weight)
    start, rows, _ = vocab_rows(vocab_size, tp)
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside[:, None], 0)
    return tp.all_reduce(out)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Every rank's logits columns side by side, without the padding rows' columns."""
    if not tp.parallel:
        return local
    return tp.gather_last_dim(local)[:, :vocab_size]


def parameter_slice(
    param_name: str, shard: object, local: torch.Tensor, spec: DecoderSpec, tp: TPGroup
) -> ShardSlice | None:
    """Where this rank's `local` part of a checkpoint tensor lies in it (None: the rank
    holds it whole). `shard`: which checkpoint tensor of a fused parameter (q/k/v, gate/up)."""
    if not tp.parallel or param_name.startswith("visual."):  # a vision tower: on every rank
        return None
    if param_name in ("model.embed_tokens", "lm_head"):
        start, rows, _ = vocab_rows(spec.vocab_size, tp)
        return ShardSlice(0, start, rows, spec.vocab_size)
    module, _, kind = param_name.rpartition(".")
    module = module.rpartition(".")[2]
    if module == "experts":  # `kind`: the stacked parameter (gate_up_proj, down_proj)
        return expert_slice(param_name, kind, shard, local, tp)
    if module == "qkv_proj":
        return head_rows(spec, tp, kv=shard != 0)
    if module in ("q_norm", "k_norm") and not spec.qk_norm_per_head:  # OLMoE: whole q, k
        return head_rows(spec, tp, kv=module == "k_norm")
    if module == "gate_up_proj":  # `local`: this rank's gate (or up) rows
        size = local.shape[0]
        return ShardSlice(0, tp.rank * size, size, size * tp.size)
    if module in ("o_proj", "down_proj") and kind == "weight":
        size = local.shape[1]
        return ShardSlice(1, tp.rank * size, size, size * tp.size)
    return None


def expert_slice(
    param_name: str, stacked: str, shard: object, local: torch.Tensor, tp: TPGroup
) -> ShardSlice:
    """This rank's slice of an expert tensor: its share of the intermediate dimension of
    every expert (gate/up rows, down_proj columns). `shard`: (expert, part) for one expert's
    tensor ([inter, hidden] or [hidden, inter]); (None, part) for the gate (0) or up (1) half
    of a stacked gate_up_proj; None for a stacked tensor whole ([experts, ...]). Under
    expert parallelism the rank holds a range of whole experts instead: its rows of a
    stacked tensor, an expert's tensor whole (`MoeForCausalLM` skips the others')."""
    if tp.expert_parallel:  # whole experts, a range of them on each rank
        if isinstance(shard, tuple):
            return None  # one expert's tensor, whole on the rank holding it
        count = local.shape[0]
        return ShardSlice(0, tp.rank * count, count, count * tp.size)
    part = shard[1] if isinstance(shard, tuple) else None
    if stacked == "down_proj":
        dim = local.dim() - 1  # input columns, the last dimension
    elif part is not None:
        dim = local.dim() - 2  # output rows of one half (gate or up)
    else:
        # A stacked gate_up_proj whole: the rank holds a range of its gate rows and one of
        # its up rows, which no single slice describes (MoeForCausalLM loads it in halves).
        raise ValueError(
            f"weights: {param_name!r} is no single slice on a rank; send it per expert"
        )
    size = local.shape[dim]
    return ShardSlice(dim, tp.rank * size, size, size * tp.size)


def head_layout(spec: DecoderSpec, tp: TPGroup) -> HeadLayout:
    return HeadLayout.of(spec.num_heads, spec.num_kv_heads, tp.size, tp.rank)


def head_rows(spec: DecoderSpec, tp: TPGroup, kv: bool) -> ShardSlice:
    """This rank's rows of a tensor laid out by query heads (`kv`: key/value heads)."""
    layout, head_dim = head_layout(spec, tp), spec.head_dim
    if kv:
        return ShardSlice(0, layout.kv_head_start * head_dim, layout.kv_heads * head_dim,
                          spec.num_kv_heads * head_dim)  # fmt: skip
    return ShardSlice(0, layout.head_start * head_dim, layout.heads * head_dim,
                      spec.num_heads * head_dim)  # fmt: skip


def local_intermediate(size: int, tp: TPGroup, field: str = "intermediate_size") -> int:
    """An MLP's intermediate columns on this rank; `field`: the config key of `size`."""
    return even_split(size, tp.size, tp.rank, field)[1]
