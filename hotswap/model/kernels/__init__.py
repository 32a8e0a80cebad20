"""hotswap's own CPU kernels (C++, built once per machine): paged decode attention that
reads the KV cache in place (over bf16 caches kept in 16-position tiles where the CPU has
AVX-512 BF16), a GEMV for the few rows of a decode step, AMX linear layers for some tens
of rows, a mixture of experts' routed experts in one call, and fused RMSNorm, RoPE and
SiLU-and-mul. The engine falls back to torch's
operators wherever they do not apply or cannot be built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotswap.model.kernels.build import isa_flags, load_cpu_kernels
from hotswap.model.kv_fp8 import is_fp8_kv

__all__ = ["CpuKernels", "LayerKernels", "load_cpu_kernels"]

# Query heads per kv head the tiled decode kernel is built for (kMaxTileGroup in
# csrc/common.h).
MAX_TILE_GROUP = 8


@dataclass(frozen=True)
class LayerKernels:
    """The ops the model layers call instead of torch operators, with the torch
    reference's signatures (model/layers.py); a layer holding None runs torch operators.
    The CPU kernels below, or the Triton ones on CUDA (model/cuda/ops.py)."""

    gemv: Callable[..., torch.Tensor] | None  # a few rows x a bf16 weight (None: F.linear)
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]  # mutates its residual argument
    rotary_embedding: Callable[..., None]  # in place
    silu_and_mul: Callable[..., torch.Tensor]
    # Qwen3's per-head q/k norm in place over [tokens, q + kv heads, dim] (None: per module)
    head_rms_norm: Callable[..., None] | None
    # a mixture of experts' routed experts in one call, reading nothing back (None: per
    # expert from Python, model/moe.py)
    fused_moe: Callable[..., torch.Tensor] | None
    # the same over FP8 experts (codes and block scales; None: per expert from Python)
    fused_moe_fp8: Callable[..., torch.Tensor] | None
    # blockwise FP8 weights (model/quantized.py): a few rows against the codes, any number
    # of rows against them (the Triton GEMM on CUDA; preferred where set), and the codes'
    # values in the activation dtype (None: torch operators dequantize)
    fp8_gemv: Callable[..., torch.Tensor] | None
    fp8_gemm: Callable[..., torch.Tensor] | None
    fp8_dequantize: Callable[..., torch.Tensor] | None


@dataclass(frozen=True)
class CpuKernels(LayerKernels):
    """hotswap's CPU kernels (`torch.ops.hotswap_cpu.*`)."""

    paged_decode_attention: Callable[..., torch.Tensor]
    paged_decode_attention_tiles: Callable[..., torch.Tensor]
    write_kv_tiles: Callable[..., None]  # in place, into the caches
    # AMX linear layers (None where the build or the process has no AMX tiles)
    amx_pack_weight: Callable[..., torch.Tensor] | None
    amx_linear: Callable[..., torch.Tensor] | None

    @classmethod
    def load(cls, progress: bool = True) -> CpuKernels | None:
        """The kernels, built first if need be; None if they cannot be built here."""
        if not load_cpu_kernels(progress):
            return None
        ops = torch.ops.hotswap_cpu
        amx = (ops.amx_pack_weight, ops.amx_linear) if ops.amx_available() else (None, None)
        return cls(
            gemv=ops.gemv,
            rms_norm=ops.rms_norm,
            add_rms_norm=ops.add_rms_norm,
            rotary_embedding=ops.rotary_embedding,
            silu_and_mul=ops.silu_and_mul,
            head_rms_norm=None,
            fused_moe=ops.fused_moe,
            fused_moe_fp8=ops.fused_moe_fp8,
            fp8_gemv=ops.fp8_gemv,
            fp8_gemm=None,  # larger batches dequantize for the GEMM library (fp8_linear.cpp)
            fp8_dequantize=ops.fp8_dequantize,
            paged_decode_attention=ops.paged_decode_attention,
            paged_decode_attention_tiles=ops.paged_decode_attention_tiles,
            write_kv_tiles=ops.write_kv_tiles,
            amx_pack_weight=amx[0],
            amx_linear=amx[1],
        )

    @staticmethod
    def tiles_apply(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    block_size: int, compute_dtype: torch.dtype | None = None) -> bool:  # fmt: skip
        """Whether the tiled cache and its kernel (csrc/paged_attention_tiles.cpp) serve
        this model: a bf16 cache (or an e4m3 or e5m2 one under bf16 queries:
        `compute_dtype`), head size 64 or 128, at most 8 query heads per kv head, blocks of
        whole tiles, on a CPU the kernels were built with AVX-512 BF16 for."""
        fp8_cache = is_fp8_kv(dtype) and compute_dtype == torch.bfloat16
        return (
            (dtype == torch.bfloat16 or fp8_cache)
            and head_dim in (64, 128)
            and heads % kv_heads == 0
            and heads // kv_heads <= MAX_TILE_GROUP
            and block_size % 16 == 0
            and "-mavx512bf16" in isa_flags()
        )
