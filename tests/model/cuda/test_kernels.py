"""Every Triton kernel against its torch reference, on CPU tensors under Triton's
interpreter (on a GPU the same tests run on CUDA tensors): the norms, RoPE and SiLU as
model/layers.py computes them, the KV store against `write_kv`, and both attention kernels
against SDPA over each sequence's context gathered from the paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hotswap.model.attention import write_kv
from hotswap.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul
from tests.model.cuda.conftest import DEVICE, ops

# bf16: Triton's interpreter rounds float32 to bf16 by truncation (a GPU to nearest), so
# a bf16 result may be one unit in the last place off.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])  # fmt: skip


def norm(size: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    module = RMSNorm(size, 1e-6, weight_dtype or dtype)
    module.weight.data = torch.randn(size, dtype=weight_dtype or dtype, device=DEVICE)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [64, 100])
def test_rms_norm_and_add_rms_norm_match_the_torch_norm(dtype: torch.dtype, size: int) -> None:
    module = norm(size, dtype)
    wide = torch.randn(7, size + 9, dtype=dtype, device=DEVICE)
    x = wide[:, :size]  # rows strided, as a slice of a wider projection
    close(ops.rms_norm(x, module.weight, 1e-6), module(x), dtype)
    residual = torch.randn(7, size, dtype=dtype, device=DEVICE)
    want_residual = residual.clone()
    want = module(x, want_residual)[0]
    got = ops.add_rms_norm(x, residual, module.weight, 1e-6)
    close(got, want, dtype)
    close(residual, want_residual, dtype)  # the residual holds the sum


def test_a_float32_weight_keeps_a_bf16_input_unrounded() -> None:
    """The final norm ahead of a float32 LM head: bf16 in, float32 weight and out."""
    module = norm(64, torch.bfloat16, torch.float32)
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)
    got = ops.rms_norm(x, module.weight, 1e-6)
    assert got.dtype == torch.float32
    close(got, module._norm(x), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norm_normalises_q_and_k_heads_in_place(dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 4, 2, 32
    q_norm, k_norm = norm(dim, dtype), norm(dim, dtype)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE)
    qk = qkv[:, : (heads + kv_heads) * dim].view(5, heads + kv_heads, dim)
    q, k = qk.split([heads, kv_heads], dim=1)
    want = torch.cat([q_norm(q), k_norm(k)], dim=1)
    untouched = qkv[:, (heads + kv_heads) * dim :].clone()
    ops.head_rms_norm_(qk, q_norm.weight, k_norm.weight, heads, 1e-6)
    close(qk, want, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], untouched)  # v is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 128])
def test_rotary_rotates_in_place_as_the_torch_rotation(dtype: torch.dtype, dim: int) -> None:
    rotary = RotaryEmbedding(dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 1, 17, 4095, 300], device=DEVICE)
    cos, sin = rotary(positions, dtype)
    qkv = torch.randn(5, 6 * dim + 3, dtype=dtype, device=DEVICE)
    qk = qkv[:, : 6 * dim].view(5, 6, dim)
    want = apply_rotary(qk.clone(), (cos, sin))
    ops.rotary_embedding_(qk, cos.view(5, dim), sin.view(5, dim))
    close(qk, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [48, 1500])  # one column block, and two
def test_silu_and_mul_matches_torch(dtype: torch.dtype, size: int) -> None:
    gate_up = torch.randn(4, 2 * size, dtype=dtype, device=DEVICE) * 3
    close(ops.silu_and_mul(gate_up), silu_and_mul(gate_up.clone()), dtype)


def test_store_kv_writes_each_slot_and_skips_padding_rows() -> None:
    blocks, block_size, kv_heads, dim = 6, 16, 2, 32
    k_cache = torch.zeros(blocks, block_size, kv_heads, dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, (4 + 2 * kv_heads) * dim, device=DEVICE)  # keys/values strided
    key = qkv[:, 4 * dim : 6 * dim].view(5, kv_heads, dim)
    value = qkv[:, 6 * dim :].view(5, kv_heads, dim)
    slots = torch.tensor([0, 17, -1, 95, 40], device=DEVICE)  # row 2 is padding
    ops.store_kv_(key, value, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    real = slots >= 0
    write_kv(key[real], value[real], (want_k, want_v), slots[real])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def paged_cache(lengths: list[int], kv_heads: int, dim: int, block_size: int,
                dtype: torch.dtype, seed: int = 0):  # fmt: skip
    """Random caches and a shuffled block table per sequence ([seqs, width] padded with
    garbage block ids beyond each sequence's blocks, as the engine's tables may be)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    blocks = sum(need) + 3
    shape = (blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    order = torch.randperm(blocks, generator=gen).tolist()
    width = max(need) + 1
    tables = []
    for n in need:
        own, order = order[:n], order[n:]
        tables.append(own + [blocks - 1] * (width - n))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def reference(q, k_cache, v_cache, table, length: int, scale: float):  # noqa: ANN001, ANN201
    """SDPA in float32 of q [queries, heads, dim], the last queries of `length` positions."""
    heads = q.shape[1]
    keys = k_cache[table.long()].flatten(0, 1)[:length].float()
    values = v_cache[table.long()].flatten(0, 1)[:length].float()
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [heads, L, dim]
    values = values.repeat_interleave(group, 1).transpose(0, 1)
    queries = q.shape[0]
    positions = torch.arange(length - queries, length, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values,
                                         attn_mask=mask, scale=scale)  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attends_each_sequence_over_its_blocks(
    dtype: torch.dtype, heads: int, kv_heads: int, splits: int
) -> None:
    dim, block_size = 32, 16
    lengths = [1, 15, 16, 17, 64, 131]  # across block and tile edges
    k_cache, v_cache, tables = paged_cache(lengths, kv_heads, dim, block_size, dtype)
    q = torch.randn(len(lengths), heads, dim).to(dtype).to(DEVICE)
    out = torch.full((len(lengths) + 2, heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ops.paged_decode_(out, q, k_cache, v_cache, tables, lens, dim**-0.5, splits, 16)
    for i, length in enumerate(lengths):
        want = reference(q[i : i + 1], k_cache, v_cache, tables[i], length, dim**-0.5)[0]
        close(out[i], want, dtype)
    assert out[len(lengths) :].isnan().all()  # rows past the decode rows untouched


def test_decode_over_a_long_context_with_more_splits_than_needed() -> None:
    dim, block_size = 16, 16
    lengths = [2000, 3]
    k_cache, v_cache, tables = paged_cache(lengths, 1, dim, block_size, torch.float32)
    q = torch.randn(2, 2, dim, device=DEVICE)
    out = torch.empty_like(q)
    lens = torch.tensor(lengths, device=DEVICE)  # int64 lengths are read as well
    ops.paged_decode_(out, q, k_cache, v_cache, tables.long(), lens, 0.3, 8, 64)
    for i, length in enumerate(lengths):
        close(out[i], reference(q[i : i + 1], k_cache, v_cache, tables[i], length, 0.3)[0],
              torch.float32)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 1)])
@pytest.mark.parametrize("aligned", [False, True])
def test_prefill_with_cached_prefixes_and_chunks(
    dtype: torch.dtype, heads: int, kv_heads: int, aligned: bool
) -> None:
    """Three sequences in one packed batch: a whole prompt, a chunk after a cached prefix
    that ends mid-block, and a chunk longer than a query tile."""
    dim, block_size, block_m = 32, 16, 16
    lengths, query_lens = [21, 53, 90], [21, 20, 37]
    k_cache, v_cache, tables = paged_cache(lengths, kv_heads, dim, block_size, dtype, seed=1)
    q = torch.randn(sum(query_lens), heads, dim).to(dtype).to(DEVICE)
    starts = [0, 21, 41]
    first_positions = [n - q for n, q in zip(lengths, query_lens)] if aligned else None
    seqs, firsts = ops.prefill_tiles(query_lens, block_m, first_positions)
    out = torch.full_like(q, float("nan"))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    ops.paged_prefill_(out, q, k_cache, v_cache, tables, as_tensor(starts),
                       as_tensor(query_lens), as_tensor(lengths), as_tensor(seqs),
                       as_tensor(firsts), dim**-0.5, block_m, 16)  # fmt: skip
    for i, (start, count) in enumerate(zip(starts, query_lens)):
        rows = slice(start, start + count)
        want = reference(q[rows], k_cache, v_cache, tables[i], lengths[i], dim**-0.5)
        close(out[rows], want, dtype)


def test_prefill_tiles_cover_every_query_once() -> None:
    assert ops.prefill_tiles([3, 40, 16], 16) == ([0, 1, 1, 1, 2], [0, 0, 16, 32, 0])
    # aligned to absolute positions: queries from 5 (3 of them) and from 30 (40 of them)
    assert ops.prefill_tiles([3, 40], 16, [5, 30]) == ([0, 1, 1, 1, 1], [-5, -14, 2, 18, 34])
