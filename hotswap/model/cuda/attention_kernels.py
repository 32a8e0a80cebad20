"""Paged attention in Triton over the natural cache layout [blocks, block_size, kv_heads,
head_dim] (model/attention.py `natural_cache`): a key position p of a sequence lives in
block table entry p // block_size, row p % block_size. Both kernels look every tile's
blocks up in the table as they go, so nothing is gathered or copied beforehand.

- `decode_split_kernel` + `decode_reduce_kernel`: one query per sequence (decode). The
  context is split into `num_splits` ranges (split-K); program (sequence, kv head, split)
  attends all the query heads that share its kv head (GQA: their rows padded to 16 for
  the tensor cores) over its range with an online softmax, and the reduce kernel merges
  the splits. The number of splits is a host integer fixed per batch size, and every
  length is read from device memory: a launch can be captured in a CUDA graph.
- `prefill_kernel`: many queries per sequence (prefill, chunked prefill after a cached
  prefix). Program (tile of BLOCK_M queries of one sequence, query head) walks the keys
  from position 0 in BLOCK_N tiles up to the tile's causal bound. Tiles may start at
  absolute positions that are multiples of BLOCK_M (`prefill_tiles(aligned=...)`), so that
  a token always sits in the same row of a tile whatever chunk it came in.

Key tiles start at position 0 in both kernels and masked scores are exactly -inf (they
add exact zeros), so a query's result depends only on its own context and its row in the
tile. The batch-invariant mode runs every row, decode rows too, through the prefill kernel
with tiles aligned to absolute positions: a token's result is then the same bits decoded
or prefilled, alone or batched, chunked or not (a matrix product's row may round
differently in another row of the tile: numpy's does, under the interpreter).

An FP8 cache (FP8, model/kv_fp8.py) holds e4m3 or e5m2 codes, read as bytes and decoded exactly
into the queries' dtype (fp8_kernels.py); the layer's k_scale is folded into the score
scale and its v_scale into the output, as the CPU kernels do: the products round once
where the torch path rounds code x scale to the dtype first (within 2^-8 relative in
bf16, far less in float32). Scales are host floats fixed at start, kernel arguments a
captured CUDA graph keeps as it keeps the softmax scale; nothing is read back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hotswap.model.cuda.fp8_kernels import kv_values


@triton.jit
def _page_offsets(table_ptr, positions, valid, BLOCK_SIZE: tl.constexpr):
    """Element offsets (in units of one [kv_heads, head_dim] row) of `positions` in the
    cache, through a sequence's block table row."""
    pages = tl.load(table_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return pages * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def _attend_tile(
    q, acc, row_max, row_sum, k_cache, v_cache, rows, key_valid, kv_offset, dims, dim_mask,
    allowed, scale_log2, row_width, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax (base 2; `allowed` [M, N] masks scores, the keys
    outside `key_valid` [N] are not read)."""
    offsets = rows[:, None] * row_width + kv_offset + dims[None, :]
    load_mask = key_valid[:, None] & dim_mask[None, :]
    keys = _load_kv(k_cache + offsets, load_mask, q.dtype, FP8)
    values = _load_kv(v_cache + offsets, load_mask, q.dtype, FP8)
    if UPCAST:  # Triton's interpreter multiplies bf16 as its raw bits: not for a GPU
        q, keys, values = q.to(tl.float32), keys.to(tl.float32), values.to(tl.float32)
    if IEEE:
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys))
    scores = tl.where(allowed, scores * scale_log2, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # a row with nothing allowed so far keeps max -inf: exp2 of -inf - -inf is NaN, so its
    # correction is forced to 1 (it has nothing to correct)
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(scores - safe_max[:, None])
    correction = tl.exp2(row_max - safe_max)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    if IEEE:
        update = tl.dot(probs.to(values.dtype), values, input_precision="ieee")
    else:
        update = tl.dot(probs.to(values.dtype), values)
    return acc * correction[:, None] + update, new_max, row_sum


@triton.jit
def _load_kv(ptrs, mask, dtype: tl.constexpr, FP8: tl.constexpr):
    """Keys or values in the queries' dtype; FP8: the codes' values (exact in any of the
    query dtypes), their scales applied by the callers (scale_log2, v_scale)."""
    if FP8:
        return kv_values(tl.load(ptrs, mask=mask, other=0), FP8).to(dtype)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def decode_split_kernel(
    q_ptr, k_cache, v_cache, tables_ptr, lens_ptr, acc_ptr, stats_ptr, out_ptr,
    q_stride, table_stride, out_stride, scale_log2, v_scale, num_splits, kv_heads,
    head_dim, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, DIRECT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """acc [seqs, heads, splits, DIM] float32 (unnormalised), stats [seqs, heads, splits,
    2] float32 (row max in base 2, row sum) of each split; DIRECT (one split): the
    normalised rows straight into out [seqs, heads, head_dim] instead."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, tiles)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM)
    dim_mask = dims < head_dim
    heads = kv_head * GROUP + group
    rows_ok = (group < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * head_dim + dims[None, :],
                mask=rows_ok, other=0.0)  # fmt: skip
    acc = tl.zeros([GROUP_PAD, DIM], dtype=tl.float32)
    row_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    row_width = kv_heads * head_dim
    for tile in range(first, last):
        positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = positions < length
        rows = _page_offsets(tables_ptr + seq * table_stride, positions, valid, BLOCK_SIZE)
        allowed = (group < GROUP)[:, None] & valid[None, :]
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, k_cache, v_cache, rows, valid, kv_head * head_dim,
            dims, dim_mask, allowed, scale_log2, row_width, IEEE, UPCAST, FP8,
        )  # fmt: skip
    acc = acc * v_scale  # an FP8 cache's value scale (1.0 otherwise: exact)
    if DIRECT:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + seq * out_stride + heads[:, None] * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows_ok)  # fmt: skip
    else:
        slot = (seq * kv_heads * GROUP + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(acc_ptr + slot[:, None] * DIM + dims[None, :], acc,
                 mask=(group < GROUP)[:, None])  # fmt: skip
        tl.store(stats_ptr + slot * 2, row_max, mask=group < GROUP)
        tl.store(stats_ptr + slot * 2 + 1, row_sum, mask=group < GROUP)


@triton.jit
def decode_reduce_kernel(
    acc_ptr, stats_ptr, out_ptr, out_stride, num_splits, head_dim,
    SPLITS: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """out[seq, head] = the splits merged. Program: (sequence, head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, DIM)
    present = splits < num_splits
    base = (seq * heads + head) * num_splits
    maxes = tl.load(stats_ptr + (base + splits) * 2, mask=present, other=float("-inf"))
    sums = tl.load(stats_ptr + (base + splits) * 2 + 1, mask=present, other=0.0)
    top = tl.max(maxes, axis=0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - top))
    acc = tl.load(acc_ptr + (base + splits)[:, None] * DIM + dims[None, :],
                  mask=present[:, None], other=0.0)  # fmt: skip
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + seq * out_stride + head * head_dim + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)  # fmt: skip


@triton.jit
def prefill_kernel(
    q_ptr, k_cache, v_cache, out_ptr, tables_ptr, starts_ptr, query_lens_ptr, lens_ptr,
    tile_seqs_ptr, tile_firsts_ptr, q_stride, out_stride, table_stride, scale_log2,
    v_scale, kv_heads, head_dim,
    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Queries [tokens, heads, head_dim]: sequence s owns rows starts[s] .. + query_lens[s],
    which are its last query_lens[s] positions of lens[s]. Program: (tile, query head);
    tile i covers queries tile_firsts[i] .. + BLOCK_M of sequence tile_seqs[i]."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile).to(tl.int64)
    first = tl.load(tile_firsts_ptr + tile)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    num_queries = tl.load(query_lens_ptr + seq)
    length = tl.load(lens_ptr + seq)
    queries = first + tl.arange(0, BLOCK_M)  # `first` < 0: a tile aligned before the chunk
    query_valid = (queries >= 0) & (queries < num_queries)
    query_pos = length - num_queries + queries
    dims = tl.arange(0, DIM)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + (start + queries)[:, None] * q_stride + head * head_dim + dims[None, :],
                mask=query_valid[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
    acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    bound = tl.minimum(length, length - num_queries + first + BLOCK_M)  # keys < bound
    kv_offset = (head // GROUP) * head_dim
    for key_start in range(0, bound, BLOCK_N):
        positions = key_start + tl.arange(0, BLOCK_N)
        valid = positions < bound
        rows = _page_offsets(tables_ptr + seq * table_stride, positions, valid, BLOCK_SIZE)
        allowed = (query_valid[:, None] & valid[None, :]
                   & (positions[None, :] <= query_pos[:, None]))  # fmt: skip
        acc, row_max, row_sum = _attend_tile(
            q, acc, row_max, row_sum, k_cache, v_cache, rows, valid, kv_offset, dims,
            dim_mask, allowed, scale_log2, kv_heads * head_dim, IEEE, UPCAST, FP8,
        )  # fmt: skip
    out = acc * v_scale / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(out_ptr + (start + queries)[:, None] * out_stride + head * head_dim + dims[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=query_valid[:, None] & dim_mask[None, :])  # fmt: skip
