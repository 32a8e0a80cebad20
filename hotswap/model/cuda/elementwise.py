"""Fused elementwise kernels: RMSNorm, add+RMSNorm, Qwen3's per-head q/k norm, RoPE and
SiLU-and-mul, each one launch. Every kernel computes in float32 and rounds where the torch
reference rounds (model/layers.py): a norm rounds the normalised row to the weight's dtype
before scaling, add+RMSNorm rounds the residual sum before normalising it. A program
handles whole rows, so a row's result never depends on the rows around it (batch
invariance holds for these kernels on any batch)."""

from __future__ import annotations

import triton
import triton.language as tl

from hotswap.model.cuda.fp8_kernels import kv_codes


@triton.jit
def _normalise(x, weight, mask, size, eps, out_dtype: tl.constexpr):
    """x: a float32 row; the row normalised, rounded to the weight's dtype, scaled."""
    mean = tl.sum(tl.where(mask, x * x, 0.0), axis=0) / size
    normed = (x * tl.rsqrt(mean + eps)).to(out_dtype)
    return (normed.to(tl.float32) * weight.to(tl.float32)).to(out_dtype)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, size, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _normalise(x, w, mask, size, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * size + cols, y, mask=mask)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, x_stride, size, eps, BLOCK: tl.constexpr
):  # fmt: skip
    """residual += x (rounded to the residual's dtype), then out = norm(residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + res).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * size + cols, summed, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _normalise(summed.to(tl.float32), w, mask, size, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * size + cols, y, mask=mask)


@triton.jit
def head_rms_norm_kernel(
    qk_ptr, qw_ptr, kw_ptr, token_stride, q_heads, heads, head_dim, eps,
    HEADS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """In place over [tokens, q_heads + kv_heads, head_dim] (heads contiguous): each of
    the first q_heads heads with the q weight, the rest with the k weight. Program: a
    token, all its heads."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < heads)[:, None] & (cols < head_dim)[None, :]
    ptrs = qk_ptr + token * token_stride + rows[:, None] * head_dim + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    qw = tl.load(qw_ptr + cols, mask=cols < head_dim, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + cols, mask=cols < head_dim, other=0.0).to(tl.float32)
    weight = tl.where((rows < q_heads)[:, None], qw[None, :], kw[None, :])
    mean = tl.sum(tl.where(mask, x * x, 0.0), axis=1) / head_dim
    dtype = qk_ptr.dtype.element_ty
    normed = (x * tl.rsqrt(mean + eps)[:, None]).to(dtype)
    tl.store(ptrs, (normed.to(tl.float32) * weight).to(dtype), mask=mask)


@triton.jit
def rotary_kernel(
    qk_ptr, cos_ptr, sin_ptr, token_stride, heads, head_dim,
    HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Rotate-half RoPE in place over [tokens, heads, head_dim] (heads contiguous), with
    cos/sin rows [tokens, head_dim] whose halves repeat. Program: a token, all its heads."""
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    rows = tl.arange(0, HEADS)
    cols = tl.arange(0, HALF)
    mask = (rows < heads)[:, None] & (cols < half)[None, :]
    cos = tl.load(cos_ptr + token * head_dim + cols, mask=cols < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * head_dim + cols, mask=cols < half, other=0.0).to(tl.float32)
    base = qk_ptr + token * token_stride + rows[:, None] * head_dim + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    dtype = qk_ptr.dtype.element_ty
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(base + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, size, BLOCK: tl.constexpr):
    """out[r] = silu(gate) * up for x[r] = [gate | up], each `size` wide; silu rounded to
    the input dtype first, as torch's in-place silu followed by a multiply rounds.
    Program: (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + size + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (silu * up).to(dtype), mask=mask)


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, key_stride, value_stride,
    width, k_scale, v_scale, BLOCK: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Token t's keys and values ([kv_heads * head_dim], contiguous within the token) into
    cache slot slots[t] of caches laid out [slots, kv_heads * head_dim]; a negative slot
    (a padding row) writes nothing. FP8 (fp8_kernels.py E4M3, E5M2): the caches are e4m3 or
    e5m2 codes as bytes, written as model/kv_fp8.py `quantize_kv` writes them (value /
    scale in float32, IEEE-rounded division, saturated, nearest even). Program: (token,
    column block)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        k = tl.load(key_ptr + token * key_stride + cols, mask=mask)
        v = tl.load(value_ptr + token * value_stride + cols, mask=mask)
        if FP8:
            k = kv_codes(tl.div_rn(k.to(tl.float32), k_scale), FP8)
            v = kv_codes(tl.div_rn(v.to(tl.float32), v_scale), FP8)
        tl.store(k_cache_ptr + slot * width + cols, k, mask=mask)
        tl.store(v_cache_ptr + slot * width + cols, v, mask=mask)


def block_for(size: int) -> int:
    return triton.next_power_of_2(size)
