"""The Triton kernels as torch operators (`torch.ops.hotswap_gpu.*`), launched with their
grids and block sizes here. Registered with the dispatcher rather than called as Python
functions, so that anything that watches a forward's operators (a CUDA graph's stand-in in
the tests, torch.compile) sees them; in-place operators say which arguments they write.

Import this module only after `hotswap.model.cuda.load_triton()`.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from hotswap.model.cuda.attention_kernels import (
    decode_reduce_kernel,
    decode_split_kernel,
    prefill_kernel,
)
from hotswap.model.cuda.elementwise import (
    add_rms_norm_kernel,
    block_for,
    head_rms_norm_kernel,
    rms_norm_kernel,
    rotary_kernel,
    silu_and_mul_kernel,
    store_kv_kernel,
)
from hotswap.model.cuda.fp8_kernels import E4M3, E5M2, fp8_gemm_kernel, gemm_blocks
from hotswap.model.cuda.moe_kernels import group_by_expert, grouped_gemm
from hotswap.model.kernels import LayerKernels
from hotswap.model.kv_fp8 import FP8_KV_DTYPES

LOG2E = math.log2(math.e)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Key positions per tile of the attention kernels, and query rows per prefill tile.
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
# Columns per program of the row-splitting kernels (SiLU-and-mul, the KV store).
COLUMN_BLOCK = 1024

# an FP8 cache's dtype -> the kernels' FP8 constant (fp8_kernels.py)
_FP8_FORMATS = {FP8_KV_DTYPES["fp8_e4m3"]: E4M3, FP8_KV_DTYPES["fp8_e5m2"]: E5M2}


def _precision(dtype: torch.dtype) -> dict[str, bool]:
    """IEEE: float32 products in full float32 (not TF32), as the CPU engine computes them;
    UPCAST: bf16 operands widened first where Triton's interpreter runs the kernel (it
    would multiply their raw bits)."""
    return {"IEEE": dtype == torch.float32,
            "UPCAST": INTERPRETED and dtype != torch.float32}  # fmt: skip


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=weight.dtype, device=x.device)
    if rows:
        block = block_for(size)
        rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), size, eps, BLOCK=block,
                                 num_warps=_warps(block))  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=weight.dtype, device=x.device)
    if rows:
        block = block_for(size)
        add_rms_norm_kernel[(rows,)](x, residual, weight, out, x.stride(0), size, eps,
                                     BLOCK=block, num_warps=_warps(block))  # fmt: skip
    return out


def head_rms_norm_(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float
) -> None:
    tokens, heads, dim = qk.shape
    if tokens:
        head_rms_norm_kernel[(tokens,)](qk, q_weight, k_weight, qk.stride(0), q_heads, heads,
                                        dim, eps, HEADS=block_for(heads),
                                        BLOCK=block_for(dim))  # fmt: skip


def rotary_embedding_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, heads, dim = qk.shape
    if tokens:
        rotary_kernel[(tokens,)](qk, cos, sin, qk.stride(0), heads, dim,
                                 HEADS=block_for(heads), HALF=block_for(dim // 2))  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows, width = x.shape
    size = width // 2
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    if rows:
        block = min(COLUMN_BLOCK, block_for(size))
        grid = (rows, triton.cdiv(size, block))
        silu_and_mul_kernel[grid](x, out, x.stride(0), size, BLOCK=block,
                                  num_warps=_warps(block))  # fmt: skip
    return out


def store_kv_(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The new tokens' keys and values into their slots; into an FP8 cache quantized with
    the layer's scales (model/kv_fp8.py)."""
    tokens, kv_heads, dim = key.shape
    width = kv_heads * dim
    fp8 = _fp8_cache(k_cache, k_scale, v_scale)
    if tokens:
        block = min(COLUMN_BLOCK, block_for(width))
        grid = (tokens, triton.cdiv(width, block))
        store_kv_kernel[grid](key, value, _cache_data(k_cache), _cache_data(v_cache), slots,
                              key.stride(0), value.stride(0), width, k_scale, v_scale,
                              BLOCK=block, FP8=fp8)  # fmt: skip


def _fp8_cache(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> int:
    """The kernels' FP8 constant: the format of the caches' codes (fp8_kernels.py E4M3,
    E5M2), 0 for a cache in the model dtype; scales other than 1 apply to FP8 caches only
    (as the CPU kernels check). Host floats, read with no device sync."""
    fp8 = _FP8_FORMATS.get(k_cache.dtype, 0)
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("attention: k_scale and v_scale apply to FP8 caches only")
    return fp8


def _cache_data(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels read and write: an FP8 cache as its bytes (fp8_kernels.py)."""
    return cache.view(torch.uint8) if cache.dtype in _FP8_FORMATS else cache


def paged_decode_(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int = DECODE_BLOCK_N,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rows 0..B-1 of `out` [tokens, heads, head_dim]: the B sequences' single queries
    (q [B, heads, head_dim]) attending their cached context (`lens` positions each); an
    FP8 cache read with the layer's scales."""
    seqs, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    fp8 = _fp8_cache(k_cache, k_scale, v_scale)
    if not seqs:
        return
    group, width = heads // kv_heads, block_for(dim)
    direct = num_splits == 1  # the split kernel normalises and writes the rows itself
    rows = 1 if direct else seqs * heads * num_splits
    acc = torch.empty((rows, width), dtype=torch.float32, device=q.device)
    stats = torch.empty((rows, 2), dtype=torch.float32, device=q.device)
    decode_split_kernel[(seqs, kv_heads, num_splits)](
        q, _cache_data(k_cache), _cache_data(v_cache), tables, lens, acc, stats, out,
        q.stride(0), tables.stride(0), out.stride(0), scale * LOG2E * k_scale, v_scale,
        num_splits, kv_heads, dim, GROUP=group, GROUP_PAD=max(16, block_for(group)),
        DIM=width, BLOCK_SIZE=block_size, BLOCK_N=block_n, **_precision(q.dtype),
        DIRECT=direct, FP8=fp8, num_warps=4,
    )  # fmt: skip
    if not direct:
        decode_reduce_kernel[(seqs, heads)](acc, stats, out, out.stride(0), num_splits, dim,
                                            SPLITS=block_for(num_splits), DIM=width)  # fmt: skip


def paged_prefill_(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    lens: torch.Tensor,
    tile_seqs: torch.Tensor,
    tile_firsts: torch.Tensor,
    scale: float,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The rows of `out` the sequences' queries occupy (see `prefill_kernel`); the tiles
    come from `prefill_tiles` with the same `block_m`. An FP8 cache read with the layer's
    scales."""
    tiles = tile_seqs.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    fp8 = _fp8_cache(k_cache, k_scale, v_scale)
    if not tiles:
        return
    prefill_kernel[(tiles, heads)](
        q, _cache_data(k_cache), _cache_data(v_cache), out, tables, starts, query_lens, lens,
        tile_seqs, tile_firsts, q.stride(0), out.stride(0), tables.stride(0),
        scale * LOG2E * k_scale, v_scale, kv_heads, dim, GROUP=heads // kv_heads,
        DIM=block_for(dim), BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        **_precision(q.dtype), FP8=fp8, num_warps=4,
    )  # fmt: skip


def prefill_tiles(
    query_lens: list[int], block_m: int = PREFILL_BLOCK_M, first_positions: list[int] | None = None
) -> tuple[list, list]:
    """(sequence, first query) of every tile of `block_m` queries, sequence by sequence.
    With `first_positions` (each sequence's first query's absolute position), tiles are
    aligned to absolute multiples of `block_m`: a sequence's first tile may start before
    its first query (a negative first query; those rows are masked)."""
    seqs, firsts = [], []
    for seq, count in enumerate(query_lens):
        lead = first_positions[seq] % block_m if first_positions is not None else 0
        for first in range(-lead, count, block_m):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts of model/moe.py `FusedExperts.forward` (same contract): gate/up,
    SiLU-and-mul and down for every (token, slot) pair in two grouped launches, then each
    token's slots weighted and summed in float32 in slot order."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    # -1: another rank's expert (expert parallelism): run on expert 0 and weighted zero,
    # which keeps every shape fixed by the number of tokens (CUDA graphs)
    weights = weights.masked_fill(ids < 0, 0.0)
    ids = ids.clamp(min=0)
    pairs, block_experts = group_by_expert(ids, gate_up.shape[0])
    precision = _precision(x.dtype)
    projected = torch.empty((pairs.shape[0], gate_up.shape[1]), dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up, pairs, block_experts, projected, num_pairs, top_k, gather=True,
                 scatter=False, precision=precision)  # fmt: skip
    activated = silu_and_mul(projected)  # padding rows too: never read
    out = torch.empty((num_pairs, down.shape[1]), dtype=x.dtype, device=x.device)
    grouped_gemm(activated, down, pairs, block_experts, out, num_pairs, top_k, gather=False,
                 scatter=True, precision=precision)  # fmt: skip
    mixed = (out.view(tokens, top_k, -1).float() * weights[..., None]).sum(dim=1)
    return mixed.to(x.dtype)


def fp8_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: torch.Tensor,
    block_k: int,
) -> torch.Tensor:
    """x [..., K] @ the blockwise FP8 weight^T (model/quantized.py `fp8_linear`: codes
    [N, K], block scales, each output row's scale row), in x's dtype; any number of rows,
    reading the codes in place (no dequantized weight)."""
    n, k = codes.shape
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block_m, block_n, block_kk = gemm_blocks(rows, block_k)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
        fp8_gemm_kernel[grid](
            flat, codes.view(torch.uint8), scale, scale_rows, out, rows, n, k, flat.stride(0),
            codes.stride(0), scale.stride(0), out.stride(0), block_k, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_kk, **_precision(x.dtype), num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def layer_kernels() -> LayerKernels:
    """The hooks the model's layers call (model/kernels LayerKernels)."""
    gpu = torch.ops.hotswap_gpu
    return LayerKernels(gemv=None, rms_norm=gpu.rms_norm, add_rms_norm=gpu.add_rms_norm,
                        rotary_embedding=gpu.rotary_embedding_, silu_and_mul=gpu.silu_and_mul,
                        head_rms_norm=gpu.head_rms_norm_, fused_moe=gpu.fused_moe,
                        fused_moe_fp8=None, fp8_gemv=None, fp8_gemm=gpu.fp8_gemm,
                        fp8_dequantize=None)  # fmt: skip


_LIBRARY = torch.library.Library("hotswap_gpu", "DEF")
_SCHEMAS = {
    rms_norm: "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    add_rms_norm: "add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
    head_rms_norm_: "head_rms_norm_(Tensor(a!) qk, Tensor q_weight, Tensor k_weight, "
    "int q_heads, float eps) -> ()",
    rotary_embedding_: "rotary_embedding_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()",
    silu_and_mul: "silu_and_mul(Tensor x) -> Tensor",
    store_kv_: "store_kv_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slots, float k_scale=1.0, float v_scale=1.0) -> ()",
    paged_decode_: "paged_decode_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
    "Tensor tables, Tensor lens, float scale, int num_splits, int block_n=64, "
    "float k_scale=1.0, float v_scale=1.0) -> ()",
    paged_prefill_: "paged_prefill_(Tensor(a!) out, Tensor q, Tensor k_cache, "
    "Tensor v_cache, Tensor tables, Tensor starts, Tensor query_lens, Tensor lens, "
    "Tensor tile_seqs, Tensor tile_firsts, float scale, int block_m=64, int block_n=64, "
    "float k_scale=1.0, float v_scale=1.0) -> ()",
    fused_moe: "fused_moe(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) "
    "-> Tensor",
    fp8_gemm: "fp8_gemm(Tensor x, Tensor codes, Tensor scale, Tensor scale_rows, int block_k) "
    "-> Tensor",
}
for _function, _schema in _SCHEMAS.items():
    _LIBRARY.define(_schema)
    for _key in ("CPU", "CUDA"):  # CPU: under Triton's interpreter
        _LIBRARY.impl(_schema.split("(", 1)[0], _function, _key)
