"""Building blocks shared by the decoder models. Parameters are created uninitialised:
real values always come from `load_weights` or the dummy initialiser."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.model.kernels import LayerKernels
from hotswap.model.packed import PackedWeight
from hotswap.model.quantized import fp8_linear
from hotswap.model.reference_views import serves_reference

# Batch-invariant mode runs every matmul on fixed-shape row tiles: CPU GEMM kernels pick
# their reduction order from the problem shape, so a row's result would otherwise depend on
# how many other rows share the batch. Measured: row results are then bitwise equal for
# any batch size and any row position within the tile.
INVARIANT_TILE_ROWS = 16


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    pad = (-rows) % INVARIANT_TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    tiles = [F.linear(tile, weight, bias) for tile in x.split(INVARIANT_TILE_ROWS)]
    return torch.cat(tiles)[:rows]


MatVec = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def use_kernels(model: nn.Module, kernels: LayerKernels | None) -> None:
    """Route the model's single-row products, norms, RoPE and MLP activations through
    `kernels` (None: back to torch operators)."""
    matvec = kernels.gemv if kernels is not None else None
    for module in model.modules():
        if isinstance(module, Linear):
            module.matvec = matvec
            if module.fp8 is not None:
                module.fp8.kernels = kernels
        elif hasattr(module, "kernels"):  # norms, attention (RoPE), MLPs
            module.kernels = kernels


# Up to this many rows go through the GEMV kernel, which streams the weights once for all
# of them: measured on the default model's layers, 1.5-2.2x faster than the GEMM library
# for 1-8 rows, even at 12, slower from 16 (README, Benchmarks).
MATVEC_MAX_ROWS = 8
# Up to this many rows use the packed copy of a weight; from ~1024 rows (prefill) the plain
# weight is as fast or faster (measured: 2048 rows x 3072 x 576, 4.1 vs 3.9 ms).
PACKED_MAX_ROWS = 512


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    matvec: MatVec | None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """F.linear, except for bf16 weights when kernels are set: a few rows go through
    `matvec` (the GEMM library's small-batch bf16 path streams the weights at under half
    the speed the memory allows on these CPUs; its fp32 one already runs near it), and
    larger batches through the `packed` copy of the weight."""
    if weight.dtype == torch.bfloat16:
        if matvec is not None and x.shape[0] <= MATVEC_MAX_ROWS:
            out = matvec(x, weight)
            return out if bias is None else out + bias
        if packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        self.compute_dtype = dtype  # the activations' (an FP8 weight's codes are not)
        self.batch_invariant = batch_invariant
        # set by the runner when its kernels apply / weights are prepacked
        self.matvec: MatVec | None = None
        self.packed: PackedWeight | None = None
        # FP8 storage (model/quantized.py quantize_linear): `weight` holds e4m3 codes, a
        # `weight_scale_inv` parameter their block scales, this their layout
        self.fp8: Any = None
        # adapter slots (lora/layers.py LinearLoRA), set by the runner with --enable-lora
        self.lora: Any = None
        # Row-parallel (tensor parallelism): this rank's product is a partial sum over its
        # input columns, summed across ranks (model/parallel.py TPGroup); the bias, whole on
        # every rank, is added once, after the sum.
        self.reduce: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None else None
        if self.fp8 is not None and not serves_reference(self.fp8):
            invariant = tiled_linear if self.batch_invariant else None
            out = fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8, bias, invariant)
        else:
            # the model dtype's weight; an FP8 layer's reference inside serving_reference
            # (model/reference.py), through the paths a bf16 weight takes (an FP8 layer
            # has no packed copy: `packed` is None)
            weight = self.weight if self.fp8 is None else self.fp8.reference
            if self.batch_invariant:
                out = tiled_linear(x, weight, bias)
            else:
                out = linear(x, weight, bias, self.matvec, self.packed)
        if self.lora is not None:  # before the sum: a row-parallel rank's is partial too
            out = self.lora.add_to(x, out)
        if self.reduce is not None:
            out = self.reduce.all_reduce(out)
            return out if self.bias is None else out + self.bias
        return out


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the weight's dtype (the model dtype: exactly as
    HF Llama/Qwen do). With a `residual`, first adds `x` into it in place (the decoder's
    residual stream) and normalises the sum: `(norm(residual + x), residual + x)`."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), False)
        self.eps = eps
        self.kernels: LayerKernels | None = None  # set by the runner when its kernels apply

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None and x.dim() == 2:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        residual.add_(x)  # rounds as `residual + x` does
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Rounded to the weight's dtype: the input's everywhere but a float32 final norm
        # ahead of a float32 LM head, whose input then stays unrounded.
        return self.weight * x32.to(self.weight.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in place in the gate half (no new activation-sized buffers)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed float32 cos/sin table indexed by position.
    One instance serves all layers: the step's cos/sin are looked up once."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos and sin for the step's positions, [tokens, 1, head_dim], in `dtype`
        (transformers casts them to the activation dtype the same way)."""
        cos = self.cos[positions].repeat(1, 2)[:, None, :].to(dtype)
        sin = self.sin[positions].repeat(1, 2)[:, None, :].to(dtype)
        return cos, sin


RopeTable = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """x: [tokens, heads, head_dim]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config form: top-level `rope_theta` + `rope_scaling`
    (transformers 4.x) or a `rope_parameters` dict (transformers 5.x)."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported")
    return params


def rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponent)
    if rope["rope_type"] == "linear":
        return inv_freq / float(rope["factor"])
    if rope["rope_type"] == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
