"""Where tensor-parallel ranks' slices lie: heads (split or replicated key/value heads),
the vocabulary's padded rows, sparse deltas' flat indices mapped into a slice, and experts
(each rank: every expert's share of its intermediate dimension, from per-expert or stacked
checkpoint tensors), each checked against slicing the whole tensor; the ranks' partial
sums of a mixture-of-experts block add up to the whole block's output."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hotswap.errors import InvalidArgument
from hotswap.model.models.registry import get_model_class
from hotswap.model.models.sharding import vocab_rows
from hotswap.model.parallel import HeadLayout, ShardSlice, TPGroup
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.m2n import checked_parts
from hotswap.weights.rank_writes import RankWeights
from hotswap.weights.targets import WeightTargets
from tests.helpers.moe import stacked_experts


@pytest.mark.parametrize(
    "shape,dim,start,size",
    [((6, 8), 0, 2, 3), ((6, 8), 1, 4, 4), ((3, 10, 4), 1, 5, 5), ((7,), 0, 3, 4)],
)
def test_delta_indices_land_where_slicing_the_whole_tensor_puts_them(shape, dim, start, size):
    whole = torch.arange(torch.Size(shape).numel()).reshape(shape)
    piece = ShardSlice(dim, start, size, shape[dim])
    local = piece.take(whole).contiguous()
    indices = torch.randperm(whole.numel(), generator=torch.Generator().manual_seed(0))[:20]
    mask, positions = piece.local_indices(shape, indices)
    # each kept index names the same element in the slice as in the whole tensor
    assert torch.equal(local.view(-1)[positions], whole.view(-1)[indices[mask]])
    assert int(mask.sum()) == sum(int(i) in set(local.view(-1).tolist()) for i in indices)
    assert piece.full_shape(tuple(local.shape)) == shape


@pytest.mark.parametrize(
    "heads,kv_heads,ranks,expected",
    [
        (4, 2, 2, [(2, 1, 0, 0), (2, 1, 2, 1)]),  # key/value heads split
        (4, 1, 2, [(2, 1, 0, 0), (2, 1, 2, 0)]),  # one key/value head, on both ranks
        (8, 2, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]),
    ],
)
def test_each_rank_reads_the_key_value_head_its_query_heads_use(heads, kv_heads, ranks, expected):
    layouts = [HeadLayout.of(heads, kv_heads, ranks, rank) for rank in range(ranks)]
    assert [(x.heads, x.kv_heads, x.head_start, x.kv_head_start) for x in layouts] == expected
    group = heads // kv_heads
    for layout in layouts:  # grouped-query attention: query head h reads kv head h // group
        own = range(layout.head_start, layout.head_start + layout.heads)
        assert {h // group for h in own} == set(
            range(layout.kv_head_start, layout.kv_head_start + layout.kv_heads)
        )


@pytest.mark.parametrize(
    "heads,kv_heads,ranks,what",
    [(6, 2, 4, "num_attention_heads"), (8, 3, 2, "num_key_value_heads"), (12, 3, 4, "multiple")],
)
def test_a_split_that_does_not_divide_is_refused_naming_the_flag(heads, kv_heads, ranks, what):
    with pytest.raises(InvalidArgument, match=what) as refused:
        for rank in range(ranks):
            HeadLayout.of(heads, kv_heads, ranks, rank)
    assert refused.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("vocab,ranks", [(384, 2), (385, 2), (49152, 3), (5, 4)])
def test_vocabulary_rows_cover_it_once_with_equal_allocations(vocab: int, ranks: int) -> None:
    rows = [vocab_rows(vocab, TPGroup(rank, ranks)) for rank in range(ranks)]
    assert len({allocated for _, _, allocated in rows}) == 1
    covered = [i for start, real, _ in rows for i in range(start, start + real)]
    assert covered == list(range(vocab))


def test_a_single_rank_group_is_the_identity() -> None:
    group = TPGroup()
    x = torch.randn(3, 4)
    assert group.all_reduce(x) is x and group.gather_last_dim(x) is x
    assert group.broadcast_object({"a": 1}) == {"a": 1}
    assert group.gather_objects("x") == ["x"]


# -- mixture-of-experts models ------------------------------------------------------------
EXPERTS = "model.layers.0.mlp.experts"


def moe_model(path: Path, tp: TPGroup, **config) -> torch.nn.Module:
    """The model of checkpoint `path` (config.json with `config` over it), as rank
    `tp.rank` of `tp.size` builds it (no group: collectives are never reached here)."""
    hf_config = {**json.loads((path / "config.json").read_text()), **config}
    cls = get_model_class(hf_config["architectures"][0])
    return cls(hf_config, torch.float32, None, False, None, tp)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_dir(request, tiny_model_factory) -> Path:  # noqa: ANN001
    """Qwen3-MoE with a dense layer, Qwen2-MoE with a shared expert, Mixtral's names."""
    return tiny_model_factory(request.param)


def loaded(path: Path, tp: TPGroup, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = moe_model(path, tp)
    assert model.load_weights(tensors.items()) == model.expected_checkpoint_keys()
    return model


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_each_rank_holds_its_share_of_every_expert(moe_dir: Path, stacked: bool) -> None:
    tensors = load_file(str(moe_dir / "model.safetensors"))
    if stacked:  # transformers 5's names: gate_up_proj loads as its gate and up halves
        tensors = stacked_experts(tensors)
    whole = loaded(moe_dir, TPGroup(), tensors)
    for rank in range(2):
        model = loaded(moe_dir, TPGroup(rank, 2), tensors)
        for block, full in zip(model.sparse_blocks(), whole.sparse_blocks(), strict=True):
            inter = full.experts.down_proj.shape[2]
            own = slice(rank * inter // 2, (rank + 1) * inter // 2)
            gate, up = full.experts.gate_up_proj.split(inter, dim=1)
            assert torch.equal(block.experts.gate_up_proj, torch.cat([gate[:, own], up[:, own]], 1))
            assert torch.equal(block.experts.down_proj, full.experts.down_proj[:, :, own])
            assert torch.equal(block.gate.weight, full.gate.weight)  # the router: whole


def test_the_ranks_partial_sums_add_up_to_the_block(moe_dir: Path) -> None:
    tensors = load_file(str(moe_dir / "model.safetensors"))
    whole = loaded(moe_dir, TPGroup(), tensors).sparse_blocks()[0]
    groups = [TPGroup(rank, 2) for rank in range(2)]
    blocks = [loaded(moe_dir, group, tensors).sparse_blocks()[0] for group in groups]
    x = torch.randn(7, whole.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    partials = []
    for block, group in zip(blocks, groups):
        assert block.reduce is group  # one all-reduce for the block...
        if block.shared_expert is not None:  # ... none inside its shared expert
            assert block.shared_expert.down_proj.reduce is None
        block.reduce = None  # the sum across ranks is made here
        with torch.no_grad():
            partials.append(block(x))
    with torch.no_grad():
        expected = whole(x)
    torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-5)
    for block in blocks:  # every rank routes alike: the router is whole on each
        assert torch.equal(block.last_expert_ids, whole.last_expert_ids)


def test_a_stacked_gate_up_has_no_single_slice_and_is_refused_where_one_is_needed(
    tiny_model_factory,  # noqa: ANN001
) -> None:
    """Whole-tensor rounds take it (its whole shape checked); m2n's parts and sparse
    deltas need this rank's share as one slice of it: refused naming the tensor."""
    model = moe_model(tiny_model_factory("qwen3_moe"), TPGroup(1, 2))  # 8 experts of 32
    share = ShardSlice(0, 16, 16, 32)
    assert model.checkpoint_slice(f"{EXPERTS}.3.gate_proj.weight") == share
    assert model.checkpoint_slice(f"{EXPERTS}.3.up_proj.weight") == share
    assert model.checkpoint_slice(f"{EXPERTS}.3.down_proj.weight") == ShardSlice(1, 16, 16, 32)
    assert model.checkpoint_slice(f"{EXPERTS}.down_proj") == ShardSlice(2, 16, 16, 32)
    assert model.checkpoint_slice("model.layers.0.mlp.gate.weight") is None  # the router
    stacked = f"{EXPERTS}.gate_up_proj"
    assert model.checkpoint_shape(stacked) == (8, 64, 64)
    with pytest.raises(ValueError, match="per-expert") as refused:
        model.checkpoint_slice(stacked)
    assert stacked in str(refused.value)
    ranks = RankWeights()
    ranks.model = model
    ranks._check_shape(stacked, torch.zeros(8, 64, 64))  # a whole-tensor round: the whole
    with pytest.raises(ValueError, match="shape mismatch"):
        ranks._check_shape(stacked, torch.zeros(8, 32, 64))
    declared = SimpleNamespace(names=["model.norm.weight", stacked], shapes=[[64], [8, 64, 64]])
    with pytest.raises(InvalidArgument, match="per-expert") as refused:
        checked_parts(ranks, declared)  # m2n: each engine rank's part of each tensor
    assert refused.value.field == "init_info.names[1]"
    targets = WeightTargets(model)
    meta = ParamMeta(stacked, torch.float32, (8, 64, 64))
    assert targets.check(meta, True) is None
    what, why = targets.check(meta, True, sparse=True)
    assert what == "name" and "per-expert" in why
    down = ParamMeta(f"{EXPERTS}.down_proj", torch.float32, (8, 64, 32))
    assert targets.check(down, True, sparse=True) is None


@pytest.mark.parametrize(
    "arch,config,key",
    [
        ("qwen3_moe", {"moe_intermediate_size": 31}, "moe_intermediate_size"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 47}, "shared_expert_intermediate_size"),
        ("mixtral", {"intermediate_size": 33}, "intermediate_size"),
    ],
)
def test_an_expert_width_the_ranks_do_not_divide_is_refused(
    tiny_model_factory,  # noqa: ANN001
    arch: str,
    config: dict,
    key: str,
) -> None:
    with pytest.raises(InvalidArgument, match=f"does not divide the model's {key} ") as refused:
        moe_model(tiny_model_factory(arch), TPGroup(0, 2), **config)
    assert refused.value.field == "tensor_parallel_size"
    moe_model(tiny_model_factory(arch), TPGroup(0, 1), **config)  # one rank takes any width


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_olmoe_norm_weights_follow_each_ranks_heads(tiny_model_factory, kv_heads: int) -> None:  # noqa: ANN001
    """OLMoE normalises q and k whole: each rank holds its heads' part of the norms' weights
    (a replicated key/value head's on every rank that holds it)."""
    path = tiny_model_factory("olmoe", num_key_value_heads=kv_heads)
    tensors = load_file(str(path / "model.safetensors"))
    whole = loaded(path, TPGroup(), tensors).model.layers[0].self_attn
    head_dim = whole.head_dim
    for rank in range(2):
        attention = loaded(path, TPGroup(rank, 2), tensors).model.layers[0].self_attn
        q_rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)  # 4 heads: 2 each
        kv_head = rank if kv_heads == 2 else 0
        k_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        assert torch.equal(attention.q_norm.weight, whole.q_norm.weight[q_rows])
        assert torch.equal(attention.k_norm.weight, whole.k_norm.weight[k_rows])
