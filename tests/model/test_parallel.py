"""Where tensor-parallel ranks' slices lie: heads (split or replicated key/value heads),
the vocabulary's padded rows, and sparse deltas' flat indices mapped into a slice, each
checked against slicing the whole tensor."""

from __future__ import annotations

import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.model.models.sharding import vocab_rows
from hotswap.model.parallel import HeadLayout, ShardSlice, TPGroup


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
